"""xlaunch.llm's fused operators at decode (one new token): µs per call of the compiled kernels, their
pure-torch paths, and the plain Hugging Face-style torch code they replace.

Shapes: Llama-like, hidden 1024, 16 heads (MHA) of 64, intermediate 2816, bf16; batch 1 and 4;
cache lengths 128 and 1024 (filled up to the new token); 1 and 2 threads.

  rms_norm      HF LlamaRMSNorm's forward
  add_rms_norm  ``residual = residual + x`` then the norm (HF's decoder layer)
  silu_mul      ``silu(gate) * up`` on separate gate/up outputs (HF's MLP)
  rope+cache    HF ``apply_rotary_pos_emb`` on q and k plus the static cache's two ``index_copy_``;
                ours: one ``rope_write_cache_``
  attention     ``scaled_dot_product_attention`` over the filled cache (``enable_gqa``) and the
                transposes around it; ours: ``cache_attention``

Each sample times a loop of calls and divides; rounds interleave the three paths (medians). Run
under ``flock /tmp/xlaunch-bench.lock`` on a shared machine:

    flock /tmp/xlaunch-bench.lock .venv/bin/python bench/llm_ops.py [--rounds 9] [--calls 40] [--threads 1 2]
                                                                    [--cpu-time]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from xlaunch.llm import fused, native

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import COUNT  # noqa: E402
from _machine_bench import this_machine  # noqa: E402

HIDDEN, HEADS, HEAD, INTER, EPS = 1024, 16, 64, 2816, 1e-6
DTYPE = torch.bfloat16
Call = Callable[[], object]


def loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as f:
        return " ".join(f.read().split()[:3])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def cases(batch: int, length: int) -> dict[str, dict[str, Call]]:
    """op -> {path: a call}, for one batch size and cache length."""
    torch.manual_seed(0)
    x, residual = torch.randn(batch, 1, HIDDEN, dtype=DTYPE), torch.randn(batch, 1, HIDDEN, dtype=DTYPE)
    weight = torch.rand(HIDDEN, dtype=DTYPE) + 0.5
    gate_up = torch.randn(batch, 1, 2 * INTER, dtype=DTYPE)
    gate, up = gate_up[..., :INTER].contiguous(), gate_up[..., INTER:].contiguous()
    qkv = torch.randn(batch, 1, 3 * HIDDEN, dtype=DTYPE)
    q, k, v = (qkv[..., i * HIDDEN:(i + 1) * HIDDEN].view(batch, 1, HEADS, HEAD) for i in range(3))
    start = length - 1
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD, 2).float() / HEAD))
    angle = torch.cat((start * inv, start * inv))[None, None].expand(batch, 1, HEAD)
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    k_cache, v_cache = (torch.randn(batch, HEADS, length, HEAD, dtype=DTYPE) for _ in range(2))
    position = torch.tensor([start])
    q_hf, k_hf, v_hf = (t.transpose(1, 2) for t in (q, k, v))      # HF's [B, heads, S, D]
    cos_hf, sin_hf = cos.to(DTYPE)[:, None], sin.to(DTYPE)[:, None]
    scale = 1 / math.sqrt(HEAD)

    def hf_rope_cache() -> None:
        q_rot = q_hf * cos_hf + rotate_half(q_hf) * sin_hf
        k_rot = k_hf * cos_hf + rotate_half(k_hf) * sin_hf
        k_cache.index_copy_(2, position, k_rot)
        v_cache.index_copy_(2, position, v_hf)
        return q_rot

    def hf_attention() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_hf, k_cache[:, :, :length], v_cache[:, :, :length], scale=scale)
        return out.transpose(1, 2).reshape(batch, 1, HIDDEN)

    ours: dict[str, Call] = {
        "rms_norm": lambda: fused.rms_norm(x, weight, EPS),
        "add_rms_norm": lambda: fused.add_rms_norm(x, residual, weight, EPS),
        "silu_mul": lambda: fused.silu_mul(gate_up),
        "rope+cache": lambda: fused.rope_write_cache_(q, k, v, cos, sin, k_cache, v_cache, start),
        "attention": lambda: fused.cache_attention(q, k_cache, v_cache, start, None, scale),
    }
    hf: dict[str, Call] = {
        "rms_norm": lambda: hf_rms_norm(x, weight),
        "add_rms_norm": lambda: hf_rms_norm(residual + x, weight),
        "silu_mul": lambda: F.silu(gate) * up,
        "rope+cache": hf_rope_cache,
        "attention": hf_attention,
    }
    return {op: {"native": call, "torch": call, "hf": hf[op]} for op, call in ours.items()}


def timed(call: Call, path: str, calls: int, clock: Callable[[], float]) -> float:
    """µs per call over a loop of ``calls`` (after one warm call)."""
    with native.prefer_native(path == "native"):
        call()
        start = clock()
        for _ in range(calls):
            call()
        return (clock() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=COUNT, default=9)
    parser.add_argument("--calls", type=COUNT, default=40)
    parser.add_argument("--threads", type=COUNT, nargs="+", default=[1, 2])
    parser.add_argument("--cpu-time", action="store_true",
                        help="the process's CPU time instead of the wall clock (a shared machine's 1-thread rows; "
                             "with 2 threads it sums both threads, spinning included)")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if not native.available():
        print("xlaunch.llm kernels not built: run `python -m xlaunch.llm.native` first")
        return 1
    print(this_machine())
    print(f"torch {torch.__version__}, {DTYPE}, {'CPU' if args.cpu_time else 'wall'} time, load before: {loadavg()}")
    print("| op | batch | cache | threads | native µs | torch path µs | HF torch µs | HF / native |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in (1, 4):
        for length in (128, 1024):
            table = cases(batch, length)
            for op, paths in table.items():
                if op != "attention" and length != 128:
                    continue                              # only attention depends on the cache length
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    samples: dict[str, list[float]] = {path: [] for path in paths}
                    for _ in range(args.rounds):
                        for path, call in paths.items():
                            samples[path].append(timed(call, path, args.calls, clock))
                    med = {path: statistics.median(values) for path, values in samples.items()}
                    cache = str(length) if op == "attention" else "-"
                    print(f"| {op} | {batch} | {cache} | {threads} | {med['native']:.1f} | {med['torch']:.1f} | "
                          f"{med['hf']:.1f} | {med['hf'] / med['native']:.2f}x |", flush=True)
    print(f"load after: {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
