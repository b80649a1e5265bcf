"""``--check-isa --probe``: measure instead of inferring from flags.

Runs ``python -m xlaunch.kernels.probe_worker`` in a child process (the launcher never imports
torch) that turns oneDNN verbose on for each case's first call, reads which oneDNN implementation, and so which ISA, each timed
GEMM/convolution dispatched to, and turns the measured GFLOP/s (GOP/s for int8) into advice.

    result = run_probe(seconds_budget=12)     # JSON-able dict
    print(format_probe(result))
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

from xlaunch.launcher.observe.kernels import isa_of, parse_line

MARKER = "XLAUNCH_PROBE"
WORKER = "xlaunch.kernels.probe_worker"
# Time the child may spend importing torch and starting, on top of the measuring budget.
STARTUP_ALLOWANCE_S = 60.0


class ProbeError(RuntimeError):
    """The probe child failed; the message holds its exit status and the end of its stderr."""


def parse_verbose_line(line: str) -> Optional[dict[str, str]]:
    """``{"kind", "impl", "isa"}`` for a oneDNN execution line, else None.

    The layouts are those of :func:`xlaunch.launcher.observe.kernels.parse_line` (the parser
    ``--kernel-report`` uses). ``isa`` is the ISA named in the implementation (``jit:avx2`` ->
    ``avx2``), or "" when the name carries none (``gemm:jit``).
    """
    parsed = parse_line(line)
    if parsed is None or parsed.what != "exec":
        return None
    return {"kind": parsed.kind, "impl": parsed.impl, "isa": isa_of(parsed.impl)}


def parse_output(stdout: str) -> dict[str, Any]:
    """Attribute verbose lines to the case marked before them; read the info lines and result."""
    info: dict[str, str] = {}
    primitives: dict[int, list[dict[str, str]]] = {}
    current: Optional[int] = None
    payload: Optional[dict[str, Any]] = None
    for line in stdout.splitlines():
        if line.startswith(MARKER + " "):
            rest = line[len(MARKER) + 1:]
            if rest.startswith("case "):
                current = int(rest.split()[1])
            elif rest.startswith("result "):
                payload = json.loads(rest[len("result "):])
            else:
                current = None
            continue
        verbose = parse_line(line)
        if verbose is None:
            continue
        if verbose.what == "info":
            if verbose.isa:
                info["isa"] = verbose.isa
            if verbose.version:
                info["version"] = verbose.version
        elif verbose.what == "exec" and current is not None and verbose.kind != "reorder":
            parsed = {"kind": verbose.kind, "impl": verbose.impl, "isa": isa_of(verbose.impl)}
            seen = primitives.setdefault(current, [])
            if parsed not in seen:
                seen.append(parsed)
    if payload is None:
        raise ProbeError("the probe child printed no result line")
    for case in payload["cases"]:
        case["primitives"] = primitives.get(case["index"], [])
    payload["onednn"] = info
    return payload


def _ratio(cases: list[dict[str, Any]], op: str, dtype: str) -> Optional[float]:
    by = {(c["op"], c["dtype"]): c.get("gflops") for c in cases}
    base, other = by.get((op, "fp32")), by.get((op, dtype))
    return other / base if base and other else None


def advise(cases: list[dict[str, Any]]) -> list[str]:
    """Plain advice from the measured ratios (>= 1.2x pays off, < 0.9x is slower here)."""
    for case in cases:
        case["vs_fp32"] = _ratio(cases, case["op"], case["dtype"])
    advice = []
    for dtype, what in (("bf16", "bf16 (autocast / optimize(dtype=torch.bfloat16))"),
                        ("fp16", "fp16"),
                        ("int8 static", "static INT8 (quantize(mode='static'))"),
                        ("int8 weight-only", "INT8 weight-only Linear (quantize(mode='weight_only'))")):
        ratios = {op: _ratio(cases, op, dtype) for op in ("gemm", "conv")}
        known = {op: r for op, r in ratios.items() if r is not None}
        if not known:
            continue
        parts = ", ".join(f"{op} {r:.2f}x" for op, r in known.items())
        best = max(known.values())
        if best >= 1.2:
            verdict = "pays off here"
        elif best >= 0.9:
            verdict = "about even with fp32 here; only worth it for memory savings"
        else:
            verdict = "slower than fp32 here: keep fp32"
        advice.append(f"{what}: {parts} vs fp32 -> {verdict}")
    advice.append("quantize(mode='auto') measures your own model and keeps fp32 when no INT8 route wins")
    return advice


def run_probe(seconds_budget: float = 10.0, threads: Optional[int] = 1,
              python: Optional[str] = None) -> dict[str, Any]:
    """Run the microbenchmarks in a child and return the JSON-able result (see module doc).

    ``seconds_budget`` bounds the timed rounds (torch's import comes on top, a few seconds).
    ``threads=1`` (default) measures one core's kernels: the dtype ratios are what the advice
    needs, and a single thread is not thrown off by other jobs the way an OpenMP team is on a busy
    machine; ``None`` uses torch's default thread count.
    """
    if not seconds_budget > 0:
        raise ValueError(f"probe: seconds_budget must be > 0, not {seconds_budget!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"probe: threads must be a positive integer or None, not {threads!r}")
    # The worker turns oneDNN verbose on around each case's first call only; a global
    # ONEDNN_VERBOSE would print a line per timed call and slow the timing down.
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_VERBOSE", "DNNL_VERBOSE")}
    argv = [python or sys.executable, "-m", WORKER, "--budget", f"{seconds_budget:g}",
            "--threads", str(threads or 0)]
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=seconds_budget * 2 + STARTUP_ALLOWANCE_S)
    except subprocess.TimeoutExpired as exc:   # run() killed and reaped the child
        raise ProbeError(f"the probe child did not finish within {exc.timeout:.0f} s") from exc
    if proc.returncode != 0:
        raise ProbeError(f"the probe child exited with status {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    result = parse_output(proc.stdout)
    result["seconds"] = round(time.monotonic() - start, 2)
    if proc.stderr.strip():   # never lose the child's output: warnings it printed travel along
        result["stderr"] = proc.stderr.strip()[-2000:]
    result["advice"] = advise(result["cases"])
    return result


def _dispatch(case: dict[str, Any]) -> str:
    prims = case.get("primitives") or []
    if not prims:
        return "no oneDNN primitive (ATen/BLAS kernel)"
    return "; ".join(f"{p['kind']} {p['impl']}" for p in prims)


def format_probe(result: dict[str, Any]) -> str:
    onednn = result.get("onednn", {})
    lines = [f"probe: torch {result.get('torch')}, {result.get('threads')} threads, "
             f"{result.get('seconds', '?')} s; oneDNN {onednn.get('version', '?')}, "
             f"max ISA: {onednn.get('isa', '?')}",
             f"{'op':<5} {'dtype':<17} {'shape':<15} {'GFLOP/s':>8} {'vs fp32':>8}  dispatched to"]
    for case in result["cases"]:
        if "error" in case:
            lines.append(f"{case['op']:<5} {case['dtype']:<17} {case['shape']:<15} {'-':>8} {'-':>8}  "
                         f"failed: {case['error']}")
            continue
        ratio = case.get("vs_fp32")
        lines.append(f"{case['op']:<5} {case['dtype']:<17} {case['shape']:<15} {case['gflops']:>8.1f} "
                     f"{('-' if ratio is None else f'{ratio:.2f}x'):>8}  {_dispatch(case)}")
    lines.append("(int8 rows are GOP/s)")
    lines.extend(f"advice: {a}" for a in result.get("advice", []))
    if result.get("stderr"):
        lines.append("probe child stderr:\n" + result["stderr"])
    return "\n".join(lines)
