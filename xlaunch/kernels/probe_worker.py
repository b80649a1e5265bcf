"""The torch side of ``xlaunch --check-isa --probe``: run in a child process
(``python -m xlaunch.kernels.probe_worker --budget S``).

Times a GEMM and a 3x3 convolution per dtype (fp32, bf16, fp16, int8 static through oneDNN's
quantized ops, int8 weight-only GEMM) and prints, on stdout, a marker line before each case's first call, which runs with oneDNN verbose on
(as ``ONEDNN_VERBOSE=1`` would, but only for that call), so the parent can attribute the verbose
lines to it; then times all cases in interleaved rounds and prints one JSON result line.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Optional

from xlaunch._errors import error_line
from xlaunch._torch import needs_torch

MARKER = "XLAUNCH_PROBE"
GEMM = 256          # M = N = K
CONV = (4, 32, 28)  # batch, channels in = out, height = width; 3x3 kernel, padding 1

_LIBC = ctypes.CDLL(None)


def mark(text: str) -> None:
    """One marker line, after flushing C stdio (oneDNN's verbose lines) and Python's buffers."""
    sys.stdout.flush()
    _LIBC.fflush(None)
    os.write(1, f"{MARKER} {text}\n".encode())


def _cases(torch: Any) -> list[tuple[str, str, str, float, Callable[[], Any]]]:
    """(op, dtype, shape, flops per call, run) for every case."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    n = GEMM
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    gemm_flops = 2.0 * n ** 3
    batch, ch, hw = CONV
    x, w = torch.randn(batch, ch, hw, hw, generator=gen), torch.randn(ch, ch, 3, 3, generator=gen)
    conv_flops = 2.0 * batch * ch * ch * 9 * hw * hw
    cases: list[tuple[str, str, str, float, Callable[[], Any]]] = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a_, b_, x_, w_ = a.to(dtype), b.to(dtype), x.to(dtype), w.to(dtype)
        cases.append(("gemm", name, f"{n}x{n}x{n}", gemm_flops, lambda a_=a_, b_=b_: torch.mm(a_, b_)))
        cases.append(("conv", name, f"{batch}x{ch}x{hw}x{hw} k3", conv_flops,
                      lambda x_=x_, w_=w_: F.conv2d(x_, w_, padding=1)))
    # int8 static: u8 activations x s8 per-channel weights, oneDNN's quantized engine (the same
    # primitives inductor lowers PT2E int8 graphs to).
    try:
        torch.backends.quantized.engine = "onednn"
        qa = torch.quantize_per_tensor(a.abs(), 0.05, 0, torch.quint8)
        scales, zeros = torch.full((n,), 0.02), torch.zeros(n, dtype=torch.long)
        qb = torch.quantize_per_channel(b, scales, zeros, 0, torch.qint8)
        packed_linear = torch.ops.quantized.linear_prepack(qb, None)
        cases.append(("gemm", "int8 static", f"{n}x{n}x{n}", gemm_flops,
                      lambda: torch.ops.quantized.linear(qa, packed_linear, 0.1, 0)))
        qx = torch.quantize_per_tensor(x.abs(), 0.05, 0, torch.quint8)
        qw = torch.quantize_per_channel(w, torch.full((ch,), 0.02), torch.zeros(ch, dtype=torch.long), 0, torch.qint8)
        packed_conv = torch.ops.quantized.conv2d_prepack(qw, None, [1, 1], [1, 1], [1, 1], 1)
        cases.append(("conv", "int8 static", f"{batch}x{ch}x{hw}x{hw} k3", conv_flops,
                      lambda: torch.ops.quantized.conv2d(qx, packed_conv, 0.1, 0)))
    except Exception as exc:   # quantized tensors are deprecated: say so instead of failing the probe
        cases.append(("gemm", "int8 static", f"{n}x{n}x{n}", gemm_flops, _raiser(exc)))
    wq = torch.randint(-128, 128, (n, n), dtype=torch.int8, generator=gen)
    wscale = torch.full((n,), 0.02)
    cases.append(("gemm", "int8 weight-only", f"{n}x{n}x{n}", gemm_flops,
                  lambda: torch.ops.aten._weight_int8pack_mm(a, wq, wscale)))
    return cases


def _raiser(exc: Exception) -> Callable[[], Any]:
    def run() -> Any:
        raise exc
    return run


def measure(runs: list[Callable[[], Any]], budget_s: float, batch_s: float = 0.02,
            max_rounds: int = 30) -> list[Optional[float]]:
    """Median seconds per call for each run, timed in interleaved rounds (fair under shared load)
    until ``budget_s`` is spent (at least 3 rounds). A run that raised has None."""
    per_batch = []
    for run in runs:
        start = time.perf_counter()
        run()
        per_batch.append(max(1, int(batch_s / max(time.perf_counter() - start, 1e-7))))
    samples: list[list[float]] = [[] for _ in runs]
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < 3 or (time.perf_counter() < deadline and rounds < max_rounds):
        for run, calls, out in zip(runs, per_batch, samples):
            start = time.perf_counter()
            for _ in range(calls):
                run()
            out.append((time.perf_counter() - start) / calls)
        rounds += 1
    return [statistics.median(out) for out in samples]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlaunch.kernels.probe_worker")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds for the timed rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")   # quantized-tensor deprecation notices
    try:
        with needs_torch("xlaunch --check-isa --probe"):
            import torch
    except ImportError as exc:
        if exc.name != "torch":
            raise
        sys.stderr.write(f"{exc}\n")   # one line for the parent to show, not a traceback
        return 1

    if args.threads > 0:
        torch.set_num_threads(args.threads)

    cases = _cases(torch)
    results: list[dict[str, Any]] = []
    runnable: list[tuple[dict[str, Any], float, Callable[[], Any]]] = []
    with torch.no_grad():
        # First call of each case with oneDNN verbose on: the primitive it creates and runs is
        # printed after this case's marker. Timed calls run with verbose off (printing is slow).
        for index, (op, dtype, shape, flops, run) in enumerate(cases):
            entry: dict[str, Any] = {"index": index, "op": op, "dtype": dtype, "shape": shape}
            results.append(entry)
            mark(f"case {index}")
            try:
                with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                    run()
            except Exception as exc:
                entry["error"] = error_line(exc, 200)
                continue
            runnable.append((entry, flops, run))
        mark("timing")
        seconds = measure([run for _, _, run in runnable], args.budget)
    for (entry, flops, _), per_call in zip(runnable, seconds):
        entry.update(ms=per_call * 1e3, gflops=flops / per_call / 1e9)
    payload = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cases": results}
    mark("result " + json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
