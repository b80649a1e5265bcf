"""Packed linear kernels (xlaunch.llm.linear) against torch's own CPU routes, layer by layer.

For each weight shape of the bench decoder (hidden 1024, intermediate 2816, vocab 32000) and each
number of activation rows M, the GB/s of weight read (the bytes of each route's own weight and
scales, divided by the time of one call) of:
  bf16: xlaunch_llm.bf16_linear   vs F.linear on bf16 (oneDNN)
  int8: xlaunch_llm.int8_linear   vs torch._weight_int8pack_mm (bf16 activations)
  int4: xlaunch_llm.int4_linear   vs aten._weight_int4pack_mm_for_cpu (same group size)
Routes are interleaved round by round; the median is printed. For M <= 4 each route cycles through
copies of its weights (at least --rotate-mb in all) so they come from memory, not the last-level cache.

    flock /tmp/xlaunch-bench.lock .venv/bin/python bench/llm_linear.py [--threads 1 2] [--rows 1 4 128]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

from xlaunch.llm import native
from xlaunch.llm.linear import PackedLinear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import COUNT, integer  # noqa: E402
from _machine_bench import this_machine  # noqa: E402

SHAPES = {"qkv": (3072, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816),
          "lm_head": (32000, 1024)}
F = torch.nn.functional


def routes(n: int, k: int, group: int) -> dict[str, tuple[callable, tuple]]:
    """name -> (function of (x, *weights), weights): one copy of every route's weights."""
    ops = native.ops()
    weight = torch.randn(n, k) * 0.02
    out: dict = {}
    with native.prefer_native(False):
        aten = {kind: PackedLinear(weight, None, kind, group_size=group) for kind in ("bf16", "int8", "int4")}
    out["torch bf16"] = (lambda x, w: F.linear(x, w), (aten["bf16"].weight,))
    out["torch int8"] = (lambda x, w, s: torch._weight_int8pack_mm(x, w, s),
                         (aten["int8"].weight, aten["int8"].scales.to(torch.bfloat16)))
    out["torch int4"] = (lambda x, w, s: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, s),
                         (aten["int4"].weight, aten["int4"].scales.to(torch.bfloat16)))
    if ops is not None:
        fast = {kind: PackedLinear(weight, None, kind, group_size=group) for kind in ("bf16", "int8", "int4")}
        out["xl bf16"] = (lambda x, w: ops.bf16_linear(x, w, None, n), (fast["bf16"].weight,))
        out["xl int8"] = (lambda x, w, s: ops.int8_linear(x, w, s, None, n), (fast["int8"].weight, fast["int8"].scales))
        out["xl int4"] = (lambda x, w, s: ops.int4_linear(x, w, s, None, n, group),
                          (fast["int4"].weight, fast["int4"].scales))
    return out


def measure(name_routes: dict, m: int, k: int, rounds: int, rotate_bytes: int, best: bool = False) -> dict:
    """route -> (median (or best) seconds per call over interleaved rounds, bytes of its weights)."""
    x = torch.randn(m, k, dtype=torch.bfloat16)
    sets = {}
    for name, (fn, weights) in name_routes.items():
        size = sum(t.nbytes for t in weights)
        copies = max(1, math.ceil(rotate_bytes / size)) if m <= 4 else 1
        sets[name] = (fn, [weights] + [tuple(t.clone() for t in weights) for _ in range(copies - 1)], size)
    times: dict[str, list[float]] = {name: [] for name in sets}
    for _ in range(rounds + 1):   # the first round warms up
        for name, (fn, copies, _) in sets.items():
            start = time.perf_counter()
            for weights in copies:
                fn(x, *weights)
            times[name].append((time.perf_counter() - start) / len(copies))
    pick = min if best else statistics.median
    return {name: (pick(t[1:]), sets[name][2]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=COUNT, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=COUNT, nargs="+", default=[1, 4, 128])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--group", type=COUNT, default=32)
    parser.add_argument("--rounds", type=COUNT, default=5)
    parser.add_argument("--rotate-mb", type=integer(0), default=96)
    parser.add_argument("--best", action="store_true", help="the fastest round instead of the median (a loaded machine)")
    args = parser.parse_args()
    if native.ops() is None:
        print("the xlaunch.llm kernels are not built: only torch's routes are timed")
    print(this_machine())
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}; GB/s of weight read, {'best' if args.best else 'median'} of "
          f"{args.rounds} interleaved rounds; int4 group {args.group}")
    kinds = ("bf16", "int8", "int4")
    header = f"{'shape':>8} {'M':>4} {'thr':>3} | " + " | ".join(f"{k}: xl  torch  ratio" for k in kinds)
    print(header)
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for shape in args.shapes:
                n, k = SHAPES[shape]
                rs = routes(n, k, args.group)
                for m in args.rows:
                    got = measure(rs, m, k, args.rounds, args.rotate_mb << 20, args.best)
                    cells = []
                    for kind in kinds:
                        mine, theirs = got.get(f"xl {kind}"), got[f"torch {kind}"]
                        gbs = lambda r: r[1] / r[0] / 1e9   # noqa: E731
                        if mine is None:
                            cells.append(f"{'-':>5} {gbs(theirs):6.1f} {'-':>6}")
                        else:
                            cells.append(f"{gbs(mine):5.1f} {gbs(theirs):6.1f} {theirs[0] / mine[0]:5.2f}x")
                    print(f"{shape:>8} {m:>4} {threads:>3} | " + " | ".join(cells), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
