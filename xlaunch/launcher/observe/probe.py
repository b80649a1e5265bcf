"""``--check-isa --probe``: measure instead of inferring from flags.

Runs ``python -m xlaunch.kernels.probe_worker`` in a child process (the launcher never imports
torch) that turns oneDNN verbose on for each case's first call, reads which oneDNN implementation, and so which ISA, each timed
GEMM/convolution dispatched to, and turns the measured GFLOP/s (GOP/s for int8) into advice.

    result = run_probe(seconds_budget=12, progress=StepPrinter(sys.stderr))     # JSON-able dict
    print(format_probe(result))
    verdicts(result["cases"])     # one verdict per dtype, for the --check-isa table

The child takes a while (torch's import, then the timed rounds): ``progress`` hears of each step
as the child's marker lines arrive (:class:`StepPrinter` shows them, one updating line on a
terminal, one line per step otherwise).
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from typing import Any, Callable, Optional, TextIO

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


PAYS_OFF, EVEN = 1.2, 0.9      # a dtype pays off from 1.2x fp32; below 0.9x it is slower
_ROUTES = (("bf16", "bf16", "bf16 (autocast / optimize(dtype=torch.bfloat16))"),
           ("fp16", "fp16", "fp16"),
           ("int8 static", "int8", "static INT8 (quantize(mode='static'))"),
           ("int8 weight-only", "int8", "INT8 weight-only Linear (quantize(mode='weight_only'))"))


def _verdict(best: float) -> tuple[str, str]:
    """(mark for the --check-isa table, words) for the best measured ratio to fp32."""
    if best >= PAYS_OFF:
        return "yes", "pays off here"
    if best >= EVEN:
        return "even", "about even with fp32 here; only worth it for memory savings"
    return "no", "slower than fp32 here: keep fp32"


def verdicts(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One measured verdict per dtype of the ``--check-isa`` table (bf16, fp16, int8: its best
    route): ``{"mark": yes|even|no, "ratio": best x fp32, "route": ..., "verdict": words}``."""
    found: dict[str, dict[str, Any]] = {}
    for dtype, row, _what in _ROUTES:
        ratios = [r for r in (_ratio(cases, op, dtype) for op in ("gemm", "conv")) if r is not None]
        if not ratios or (row in found and found[row]["ratio"] >= max(ratios)):
            continue
        mark, words = _verdict(max(ratios))
        found[row] = {"mark": mark, "ratio": round(max(ratios), 2), "route": dtype, "verdict": words}
    return found


def advise(cases: list[dict[str, Any]]) -> list[str]:
    """Plain advice from the measured ratios (>= 1.2x pays off, < 0.9x is slower here)."""
    for case in cases:
        case["vs_fp32"] = _ratio(cases, case["op"], case["dtype"])
    advice = []
    for dtype, _row, what in _ROUTES:
        ratios = {op: _ratio(cases, op, dtype) for op in ("gemm", "conv")}
        known = {op: r for op, r in ratios.items() if r is not None}
        if not known:
            continue
        parts = ", ".join(f"{op} {r:.2f}x" for op, r in known.items())
        advice.append(f"{what}: {parts} vs fp32 -> {_verdict(max(known.values()))[1]}")
    advice.append("quantize(mode='auto') measures your own model and keeps fp32 when no INT8 route wins")
    return advice


class StepPrinter:
    """Shows the probe's steps on ``stream``: one line rewritten in place on a terminal (with the
    seconds spent), one line per step otherwise; nothing for a child that is over within
    ``delay`` seconds (a quick failure shows its error alone)."""

    def __init__(self, stream: Optional[TextIO], delay: float = 1.0) -> None:
        self.stream = stream
        self.delay = delay
        try:
            self.tty = bool(stream is not None and stream.isatty())
        except (AttributeError, ValueError, OSError):
            self.tty = False
        self.last: Optional[str] = None

    def __call__(self, step: str, elapsed: float, *, done: bool = False) -> None:
        if self.stream is None or (step == self.last and not self.tty):
            return
        if (done and self.last is None) or (not done and elapsed < self.delay):
            return
        text = f"xlaunch: probe: {step}" + (f" ({elapsed:.0f} s)" if self.tty and not done else "")
        try:
            if self.tty:
                self.stream.write("\r\x1b[K" + text + ("\n" if done else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            self.stream = None
        self.last = step


def _stream_child(argv: list[str], env: dict[str, str], timeout: float, budget: float,
                  progress: Optional[Callable[..., None]]) -> tuple[int, str, str]:
    """Run the probe child, telling ``progress`` its steps; return (status, stdout, stderr)."""
    start = time.monotonic()
    step = "starting a torch child (importing torch takes a few seconds)"
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = bytearray(), bytearray()
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}  # type: ignore[union-attr]
    selector = selectors.DefaultSelector()
    for fd in sinks:
        selector.register(fd, selectors.EVENT_READ)
    try:
        while sinks:
            now = time.monotonic()
            if now - start > timeout:
                proc.kill()
                raise ProbeError(f"the probe child did not finish within {timeout:.0f} s")
            if progress is not None:
                progress(step, now - start)
            for key, _events in selector.select(0.5):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    del sinks[key.fd]
                    continue
                sinks[key.fd] += chunk
                if key.fd == proc.stdout.fileno():  # type: ignore[union-attr]
                    chunk = bytes(out[-len(chunk) - 64:])      # a marker split between two reads
                    if f"{MARKER} timing".encode() in chunk:
                        step = f"timing the cases in interleaved rounds (up to {budget:g} s)"
                    elif f"{MARKER} case ".encode() in chunk and step.startswith("starting"):
                        step = (f"torch loaded after {time.monotonic() - start:.0f} s; "
                                "which kernels does oneDNN pick (first call of each case)")
        status = proc.wait()
    finally:
        selector.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    if progress is not None:
        spent = time.monotonic() - start
        progress(f"done in {spent:.1f} s" if status == 0 else f"the child failed after {spent:.1f} s", spent,
                 done=True)
    return status, out.decode(errors="replace"), err.decode(errors="replace")


def run_probe(seconds_budget: float = 10.0, threads: Optional[int] = 1,
              python: Optional[str] = None, progress: Optional[Callable[..., None]] = None) -> dict[str, Any]:
    """Run the microbenchmarks in a child and return the JSON-able result (see module doc).

    ``seconds_budget`` bounds the timed rounds (torch's import comes on top, a few seconds).
    ``threads=1`` (default) measures one core's kernels: the dtype ratios are what the advice
    needs, and a single thread is not thrown off by other jobs the way an OpenMP team is on a busy
    machine; ``None`` uses torch's default thread count. ``progress(step, elapsed_s)`` is told what
    the child is doing (:class:`StepPrinter`).
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
    status, stdout, stderr = _stream_child(argv, env, seconds_budget * 2 + STARTUP_ALLOWANCE_S, seconds_budget,
                                           progress)
    if status != 0:
        raise ProbeError(f"the probe child exited with status {status}: {stderr.strip()[-1500:]}")
    result = parse_output(stdout)
    result["seconds"] = round(time.monotonic() - start, 2)
    if stderr.strip():   # never lose the child's output: warnings it printed travel along
        result["stderr"] = stderr.strip()[-2000:]
    result["advice"] = advise(result["cases"])
    result["verdicts"] = verdicts(result["cases"])
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
