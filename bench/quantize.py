"""INT8 bench for ``xlaunch.kernels.quantize``: accuracy and speed per route, interleaved medians.

    .venv/bin/python bench/quantize.py [--models cnn,encoder,mlp] [--rounds 9] [--threads N] [--no-auto]

Models (random weights, random inputs; calibration: 8 batches of the same shape):
  cnn      the examples CNN (conv/BN/ReLU stages + Linear head), batch 8, 3x32x32
  encoder  nn.TransformerEncoder, d_model 256, 4 heads, FFN 1024, 2 layers, batch 8, seq 64
  mlp      784-1024-1024-10 with ReLU, batch 64
Rows: fp32 eager, ``optimize()`` fp32, each INT8 route (``quantize(mode=...)``: torch's PT2E
and weight-only routes, then OpenVINO (NNCF) and ONNX Runtime static INT8 where installed), and
what ``mode="auto"`` picked. Under each table: torch's static INT8 against the best engine INT8
(the ratio of their times, > 1: torch is faster), with the CPU named. All rows of a model are timed round robin, so contention from other
processes hits every row alike; the table prints the median ms and the ratio to fp32 eager
(> 1 is faster), with the relative error (max |q - fp32| / max |fp32| on the calibration inputs)
and the argmax agreement.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))

from _args import COUNT, integer, names  # noqa: E402
from _machine_bench import this_machine  # noqa: E402

from infer import small_cnn  # noqa: E402

from xlaunch.kernels import optimize  # noqa: E402
from xlaunch.kernels.quantize import engine_routes, policy  # noqa: E402
from xlaunch.kernels.quantize.api import QuantizeWarning, _machine_traits, accuracy, quantize  # noqa: E402

SHAPES = {"cnn": (8, 3, 32, 32), "encoder": (8, 64, 256), "mlp": (64, 784)}


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "cnn":
        return small_cnn().eval()
    if name == "encoder":
        return Encoder().eval()
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10)).eval()
    raise SystemExit(f"--models: unknown model {name!r} (cnn, encoder, mlp)")


def interleaved(rows: dict[str, Callable[[torch.Tensor], Any]], x: torch.Tensor, rounds: int) -> dict[str, float]:
    with torch.no_grad():
        for fn in rows.values():
            fn(x)
            fn(x)
        samples: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(rounds):
            for name, fn in rows.items():
                start = time.perf_counter()
                fn(x)
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def bench(name: str, rounds: int, auto: bool) -> None:
    model = build(name)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SHAPES[name], generator=gen)
    calibration = [(torch.randn(SHAPES[name], generator=gen),) for _ in range(8)]
    rows: dict[str, Callable[[torch.Tensor], Any]] = {"fp32 eager": model}
    quality: dict[str, str] = {}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows["optimize() fp32"] = optimize(model, sample_input=x)
        with torch.no_grad():
            reference = [model(*b) for b in calibration]
            candidate = [rows["optimize() fp32"](*b) for b in calibration]
        error, agree = accuracy(reference, candidate)
        quality["optimize() fp32"] = f"{error:.4f}  {agree:.3f}"
        engines = [r for r in policy.ENGINE_INT8_ROUTES if engine_routes.missing(r) is None]
        failed: dict[str, str] = {}
        for mode in (*policy.TORCH_INT8_ROUTES, *engines):
            try:
                q = quantize(model, x, calibration=calibration, mode=mode, progress=False)
            except ValueError as error:      # this route fails here (an engine that does not import): the rest run
                failed[f"int8 {mode}"] = str(error).removeprefix("quantize: ")
                continue
            rows[f"int8 {mode}"] = q
            quality[f"int8 {mode}"] = f"{q.report.rel_error:.4f}  {q.report.argmax_agreement:.3f}"
        if auto:
            q = quantize(model, x, calibration=calibration)
            rows[f"auto -> {q.mode}"] = q
            quality[f"auto -> {q.mode}"] = ("-" if q.report.rel_error is None else
                                            f"{q.report.rel_error:.4f}  {q.report.argmax_agreement:.3f}")
    built = time.perf_counter() - start
    times = interleaved(rows, x, rounds)
    base = times["fp32 eager"]
    print(f"\n{name} {tuple(SHAPES[name])}: {rounds} interleaved rounds, built in {built:.0f} s")
    print(f"  {'variant':<22} {'median ms':>10} {'vs eager':>9}  rel.err  argmax")
    for row, ms in times.items():
        print(f"  {row:<22} {ms:>10.2f} {base / ms:>8.2f}x  {quality.get(row, '0       1.000')}")
    for row, why in failed.items():
        print(f"  {row:<22} {'-':>10} {'-':>9}  failed: {why[:200]}")
    engine_rows = [f"int8 {r}" for r in policy.ENGINE_INT8_ROUTES if f"int8 {r}" in times]
    if engine_rows and "int8 static" in times:
        best = min(engine_rows, key=times.__getitem__)
        print(f"  torch static INT8 vs the best engine INT8 ({best.removeprefix('int8 ')}): "
              f"{times[best] / times['int8 static']:.2f}x on {machine()}")


def machine() -> str:
    """The CPU, named: its model name and what it has for INT8 dot products."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            name = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dot = _machine_traits().int8_dot
    threads = torch.get_num_threads()
    return f"{name} ({dot or 'no VNNI/AMX: AVX2 multiply-add'}, {threads} thread{'s' if threads != 1 else ''})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=names(("cnn", "encoder", "mlp")), default="cnn,encoder,mlp")
    parser.add_argument("--rounds", type=COUNT, default=9)
    parser.add_argument("--threads", type=integer(0), default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-auto", action="store_true", help="skip the auto row (saves its compiles)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", QuantizeWarning)
    print(this_machine())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models:
        bench(name, args.rounds, not args.no_auto)


if __name__ == "__main__":
    main()
