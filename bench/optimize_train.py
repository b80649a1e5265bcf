"""Training-step bench: torch SGD/AdamW (foreach, fused=True) vs xlaunch's fused optimizers.

MLP 1024 -> 1024 -> 1024 -> 10, batch 64, cross-entropy. Rows, all timed interleaved (one timed
block of each row per repetition, medians over repetitions):

  fp32       torch foreach / torch fused / ours, fp32 parameters
  bf16       torch fused on fp32 parameters under bf16 autocast (the usual fp32-master recipe),
             torch fused on plain bf16 parameters (no master: lossy), ours split-bf16

Prints the median full step (zero_grad + forward + backward + step) and optimizer step alone in
ms, ratios against torch's fastest built-in in the same precision, and bytes per parameter for
the weights (params + masters + trails) and with optimizer state.

    .venv/bin/python bench/optimize_train.py [--reps 7] [--steps 10] [--batch 64]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from xlaunch.kernels.optim.fused import TRAIL_KEY, to_fused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import COUNT, integer, names  # noqa: E402
from _machine_bench import this_machine  # noqa: E402


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


@dataclass
class Row:
    precision: str
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: bool
    input_dtype: torch.dtype
    step_ms: list
    opt_ms: list


def _make_optimizer(kind: str, params, **flags) -> torch.optim.Optimizer:
    if kind == "SGD":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, **flags)
    if kind == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)
    raise ValueError(f"optimizer {kind!r}: SGD or AdamW")      # any other name measured AdamW under that name


def build_rows(kind: str, seed: int = 0) -> list[Row]:
    rows = []

    def add(precision: str, name: str, make: Callable[[nn.Module], torch.optim.Optimizer],
            model_dtype: torch.dtype = torch.float32, autocast: bool = False,
            input_dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(seed)
        model = mlp().to(model_dtype)
        rows.append(Row(precision, name, model, make(model), autocast, input_dtype, [], []))

    add("fp32", "torch foreach", lambda m: _make_optimizer(kind, m.parameters(), foreach=True))
    add("fp32", "torch fused", lambda m: _make_optimizer(kind, m.parameters(), fused=True))
    add("fp32", "xlaunch fused", lambda m: to_fused(_make_optimizer(kind, m.parameters()), m))
    add("bf16", "torch fused fp32+autocast",
        lambda m: _make_optimizer(kind, m.parameters(), fused=True), autocast=True)
    add("bf16", "torch fused pure-bf16",
        lambda m: _make_optimizer(kind, m.parameters(), fused=True),
        model_dtype=torch.bfloat16, input_dtype=torch.bfloat16)
    add("bf16", "xlaunch split-bf16",
        lambda m: to_fused(_make_optimizer(kind, m.parameters()), m, torch.bfloat16),
        input_dtype=torch.bfloat16)
    return rows


def train_step(row: Row, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step; returns the optimizer.step() time in seconds."""
    row.optimizer.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if row.autocast else contextlib.nullcontext()
    with ctx:
        loss = nn.functional.cross_entropy(row.model(x.to(row.input_dtype)).float(), y)
    loss.backward()
    start = time.perf_counter()
    row.optimizer.step()
    return time.perf_counter() - start


def bytes_per_param(row: Row) -> tuple[float, float]:
    """(weights incl. masters/trails, weights + optimizer state) bytes per trained parameter."""
    params = [p for g in row.optimizer.param_groups for p in g["params"]]
    count = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    state_bytes = 0
    for p in params:
        for key, value in row.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == p.numel():
                if key == TRAIL_KEY:
                    weights += value.numel() * value.element_size()
                else:
                    state_bytes += value.numel() * value.element_size()
    return weights / count, (weights + state_bytes) / count


def measure(kind: str, reps: int, steps: int, batch: int) -> list[Row]:
    rows = build_rows(kind)
    x = torch.randn(batch, 1024)
    y = torch.randint(0, 10, (batch,))
    for row in rows:  # warm up (state allocation, oneDNN primitive caches)
        for _ in range(3):
            train_step(row, x, y)
    for _ in range(reps):
        for row in rows:
            opt_total = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                opt_total += train_step(row, x, y)
            row.step_ms.append((time.perf_counter() - start) / steps * 1e3)
            row.opt_ms.append(opt_total / steps * 1e3)
    return rows


def report(kind: str, rows: list[Row]) -> list[str]:
    lines = [f"{kind}: MLP 1024-1024-1024-10, medians (ms); ratio = torch's fastest built-in / this"]
    lines.append(f"  {'precision':9} {'row':27} {'step':>7} {'ratio':>6} {'opt.step':>8} {'ratio':>6}"
                 f" {'B/param w':>9} {'w+state':>8}")
    for precision in ("fp32", "bf16"):
        group = [r for r in rows if r.precision == precision]
        torch_rows = [r for r in group if r.name.startswith("torch")]
        best_step = min(statistics.median(r.step_ms) for r in torch_rows)
        best_opt = min(statistics.median(r.opt_ms) for r in torch_rows)
        for r in group:
            step, opt = statistics.median(r.step_ms), statistics.median(r.opt_ms)
            w, total = bytes_per_param(r)
            lines.append(f"  {precision:9} {r.name:27} {step:7.2f} {best_step / step:6.2f} {opt:8.3f}"
                         f" {best_opt / opt:6.2f} {w:9.1f} {total:8.1f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=COUNT, default=7)
    parser.add_argument("--steps", type=COUNT, default=10)
    parser.add_argument("--batch", type=COUNT, default=64)
    parser.add_argument("--optimizers", type=names(("SGD", "AdamW")), default="SGD,AdamW")
    parser.add_argument("--threads", type=integer(0), default=0, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(this_machine())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"{args.reps} reps x {args.steps} steps")
    for kind in args.optimizers:
        print("\n".join(report(kind, measure(kind, args.reps, args.steps, args.batch))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
