"""The end-of-run summary: one row per instance for people, one JSON object for programs.

``--summary-json FILE`` writes::

    {"exit_status": 0, "allocator": "jemalloc", "openmp": "intel",
     "instances": [{"index": 0, "cpus": [0], "mem_nodes": [0], "status": "exit 0",
                    "exit_code": 0, "wall_s": 1.23, "observed": {...} | null}]}

``observed`` is what :mod:`xlaunch.launcher.observe.observer` saw while the instance ran (null when
nothing could be sampled); with ``--kernel-report`` it also holds ``kernels``, what oneDNN ran
(:meth:`~xlaunch.launcher.observe.kernels.KernelTally.to_json`), shown under the table as one line
per instance.
With ``--auto-optimize`` each instance also has ``engines``: one object per model it optimized,
``{"module": "ResNet", "backend": "onnxruntime", "cache": "hit", "reason": "..."}`` (``backend``
"torch" for the rewrite, "none" when the model runs unoptimized), shown as one line per instance.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional

from xlaunch._records import record
from xlaunch.cpulist import format_cpulist


@record
class InstanceResult:
    index: int
    cpus: tuple[int, ...]
    mem_nodes: tuple[int, ...]
    status: Optional[int]             # shell-style status; None when never started
    text: str                         # "exit 0", "killed by SIGTERM (SIGTERM forwarded)", ...
    wall_s: Optional[float]
    observed: Optional[dict[str, Any]] = None     # observe.to_json(), for the JSON
    cells: Optional[dict[str, str]] = None        # observe.cells(), for the table
    engines: Optional[list[dict[str, Any]]] = None   # --auto-optimize: each model's engine (inject.read_records)


_OBSERVED_COLUMNS = (("threads", "threads"), ("ran on", "cpus_seen"), ("allocator", "allocator"),
                     ("openmp", "openmp"), ("remote mem", "remote_mem"))


def table_lines(results: list[InstanceResult], exit_status: int, noun: str = "instance") -> list[str]:
    """Aligned rows (instance or rank, cpus, status, wall, and what was observed), then the exit status."""
    observed = any(r.cells for r in results)
    header = [noun, "cpus", "status", "wall"] + ([title for title, _key in _OBSERVED_COLUMNS] if observed else [])
    rows = [header]
    for r in results:
        row = [str(r.index), format_cpulist(r.cpus) or "-", r.text,
               f"{r.wall_s:.2f}s" if r.wall_s is not None else "-"]
        if observed:
            row += [(r.cells or {}).get(key, "-") for _title, key in _OBSERVED_COLUMNS]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for r in results:
        kernels = (r.observed or {}).get("kernels")
        if kernels is not None:
            from xlaunch.launcher.observe.kernel_report import kernel_line

            lines.append(f"instance {r.index} kernels: {kernel_line(kernels)}")
    for r in results:
        if r.engines:
            runs = "; ".join(f"{e.get('module') or '?'} on {e['backend']} (cache {e.get('cache') or 'off'})"
                             for e in r.engines)
            lines.append(f"instance {r.index} engines: {runs}")
    lines.append(f"exit status {exit_status}")
    return lines


def summary_json(results: list[InstanceResult], exit_status: int, *, allocator: str, openmp: str) -> dict[str, Any]:
    return {
        "exit_status": exit_status,
        "allocator": allocator,
        "openmp": openmp,
        "instances": [
            {
                "index": r.index,
                "cpus": list(r.cpus),
                "mem_nodes": list(r.mem_nodes),
                "status": r.text,
                "exit_code": r.status,
                "wall_s": round(r.wall_s, 6) if r.wall_s is not None else None,
                "observed": r.observed,
                **({"engines": r.engines} if r.engines is not None else {}),
            }
            for r in results
        ],
    }


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a file), never through a symlink at ``path``,
    never over a device, FIFO or socket there (:func:`xlaunch.userfiles.write_atomically`).
    Raises OSError (a :class:`~xlaunch.userfiles.UserFileError` is a ValueError, turned into one)."""
    import json

    from xlaunch.userfiles import UserFileError, write_atomically

    text = json.dumps(data, indent=2) + "\n"
    try:
        write_atomically(path, text.encode("utf-8"))
    except UserFileError as exc:
        raise OSError(str(exc)) from None
