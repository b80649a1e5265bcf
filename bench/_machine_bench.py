"""What the multi-instance benches share: shapes from the machine, the machine's description,
medians and ratios, the JSON file and the plot. Imports neither torch nor matplotlib at import.

Shapes come from the planner's own view of the machine: ``--throughput-mode`` plans one instance
per NUMA node with every usable core of that node (allowed, online, one CPU per physical core,
performance cores on a hybrid part), so its instance sizes are the cores of each node.
"""
from __future__ import annotations

import json
import math
from argparse import ArgumentTypeError
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence


def node_cores(machine: Any) -> list[int]:
    """Usable physical cores of each NUMA node with any, as the planner counts them."""
    from xlaunch.launcher.plan.options import Options
    from xlaunch.launcher.plan.planner import plan

    throughput = plan(Options(program="bench.py", python="python", throughput_mode=True), machine, {})
    return [len(instance.cpus) for instance in throughput.instances]


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers (``1,2,4``)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shapes(per_node: Sequence[int]) -> list[tuple[int, int]]:
    """(instances, cores per instance): 1xN, then kx(N/k) for every instance width that divides
    the cores of every node (so no instance spans two nodes), down to Nx1. Fewest instances first."""
    total = sum(per_node)
    if total == 0:
        return []
    widths = divisors(math.gcd(*per_node))
    found = {(1, total)} | {(total // width, width) for width in widths}
    return sorted(found)


def describe_machine(machine: Any, per_node: Sequence[int], label: Optional[str] = None) -> dict[str, Any]:
    """The machine as the JSON file names it (the model's facts plus this run's software)."""
    from xlaunch.machine import ISA_FLAGS

    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:   # not installed: the bench fails later with a clearer message
        torch_version = None
    allowed = set(machine.allowed_cpus) & set(machine.online_cpus)
    return {
        "label": label,
        "model_name": machine.isa.model_name,
        "vendor": machine.isa.vendor,
        "isa": [flag for flag in ISA_FLAGS if machine.isa.has(flag)],
        "amx_permitted": machine.isa.amx_permitted,
        "logical_cpus_allowed": len(allowed),
        "cores": sum(per_node),
        "nodes": [{"cores": n} for n in per_node],
        "smt": any(len(set(core.cpus) & allowed) > 1 for core in machine.cores),
        "l3_kib": [domain.size_kib for domain in machine.l3_domains],
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "load_average": list(os.getloadavg()),
    }


def machine_line(description: dict[str, Any]) -> str:
    nodes = description["nodes"]
    return (f"{description.get('label') or description['model_name']}: {description['cores']} cores "
            f"in {len(nodes)} node(s), {description['logical_cpus_allowed']} CPUs allowed, "
            f"ISA {' '.join(description['isa']) or '-'}; load average {description['load_average'][0]:.2f}")


def this_machine() -> str:
    """The machine this bench runs on (never ``XLAUNCH_FSROOT``'s recorded one), as :func:`machine_line` says it:
    what a bench prints first, so its figures name their machine and its ISA."""
    from xlaunch.machine import load_machine

    here = load_machine("/")
    return machine_line(describe_machine(here, node_cores(here)))


def short_line(description: dict[str, Any]) -> str:
    """The machine in a few words (for a plot's title)."""
    return (f"{description.get('label') or description['model_name']}, {description['cores']} cores, "
            f"{len(description['nodes'])} node(s), load {description['load_average'][0]:.1f}")


class Progress:
    """One line per finished run, with the time spent and an estimate of the time left."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.monotonic()

    def starting(self, what: str) -> None:
        print(f"  [{self.done + 1}/{self.total}] {what} ...", end="", flush=True)

    def finished(self, result: str) -> None:
        self.done += 1
        spent = time.monotonic() - self.started
        left = spent / self.done * (self.total - self.done)
        print(f" {result}  ({spent:.0f} s, ~{left:.0f} s left)", flush=True)


def median(values: Iterable[float]) -> Optional[float]:
    values = list(values)
    return statistics.median(values) if values else None


def paired_ratio(ours: Sequence[Optional[float]], theirs: Sequence[Optional[float]]) -> Optional[float]:
    """Median of the per-round ratios (rounds where both ran): load swings between rounds cancel."""
    ratios = [a / b for a, b in zip(ours, theirs) if a is not None and b]
    return median(ratios)


def write_results(description: dict[str, Any], json_path: Optional[str], payload: dict[str, Any],
                  final: bool = True) -> None:
    """The load-average line, and ``{"machine": description, **payload, "complete": final}`` as JSON at
    ``json_path``, replaced whole (never written through a symlink there). A bench writes it with ``final``
    False after each finished part, so a run stopped by a time limit still leaves what it measured. A
    failed write (full disk, no such folder) is one line on stderr; the bench goes on."""
    from xlaunch.userfiles import UserFileError, write_atomically

    if final:
        print(f"load average {description['load_average'][0]:.2f} at start, "
              f"{description['load_average_end'][0]:.2f} at the end")
    if not json_path:
        return
    doc = {"machine": description, **payload, "complete": final}
    try:
        write_atomically(json_path, (json.dumps(doc, indent=1) + "\n").encode())
    except (OSError, UserFileError) as error:
        print(f"could not write {json_path}: {error}", file=sys.stderr, flush=True)
        return
    if final:
        print(f"wrote {json_path}")


def plot(path: str, results: list[dict[str, Any]], *, value: str, ylabel: str, xlabel: str,
         title: str, x_of: Any, baseline: Optional[tuple[str, float]] = None) -> None:
    """A PNG: ``value`` against ``x_of(result)``, one line per launcher (``series`` of a result), at ``path``
    replaced whole (never written through a symlink there); ``wrote PATH``, or one line on stderr when it cannot
    be written (no such folder, a full disk): the run's results are already out."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    series: dict[str, list[tuple[float, float]]] = {}
    for result in results:
        if result.get(value) is not None:
            series.setdefault(result["series"], []).append((x_of(result), result[value]))
    for name, points in sorted(series.items()):
        points.sort()
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if len(points) == 1:
            axes.plot(xs, ys, marker="s", linestyle="none", label=name)
        else:
            axes.plot(xs, ys, marker="o", label=name)
    if baseline is not None and baseline[1] is not None:
        axes.axhline(baseline[1], color="grey", linestyle="--", label=baseline[0])
    axes.set_xscale("log", base=2)
    xs_all = sorted({x for points in series.values() for x, _ in points})
    axes.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=110)
    plt.close(figure)
    from xlaunch.userfiles import UserFileError, write_atomically

    try:
        write_atomically(path, image.getvalue())
    except (OSError, UserFileError) as error:
        print(f"could not write {path}: {error}", file=sys.stderr, flush=True)
        return
    print(f"wrote {path}")


def plot_available(path: Optional[str]) -> bool:
    """Whether ``--plot PATH`` can be drawn; says so at the start when matplotlib is missing
    (``pip install 'xlaunch[bench]'``), so the runs still go on and the JSON is still written."""
    if not path:
        return False
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install 'xlaunch[bench]'); no plot")
        return False
    return True


def only(configs: list, words: Sequence[str], error: Callable[[str], Any], none_hint: str = "") -> list:
    """The configurations whose name holds one of ``--only``'s words (all when none is given); a word list that
    matches none is ``error(message)`` (argparse's: one line, exit 2), naming those there are (or ``none_hint``)."""
    if not words:
        return configs
    chosen = [c for c in configs if any(word in c.name for word in words)]
    if not chosen:
        error(f"--only {', '.join(words)}: in none of this machine's configurations "
              f"({', '.join(c.name for c in configs) or none_hint})")
    return chosen


def clean_environment(extra_path: Optional[str] = None) -> dict[str, str]:
    """This process's environment without the variables a launcher sets (every peer starts alike)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "KMP_", "MKL_", "XLAUNCH_", "GOMP_")) and k not in ("LD_PRELOAD", "MALLOC_CONF")}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def python() -> str:
    return sys.executable
