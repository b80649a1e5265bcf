"""Inference bench for ``xlaunch.kernels.optimize``: one run, medians, ratios.

    .venv/bin/python bench/optimize.py [--models cnn,bert] [--rounds 7] [--backends] [--no-train] [--threads N]

Models: the examples CNN (batch 8, 3x64x64) and a BERT-like encoder built from config
(nn.TransformerEncoder, d_model 256, 4 heads, FFN 1024, 4 layers, batch 8, seq 128, random weights).
Rows: plain fp32 (eval, no_grad), plain bf16 under autocast, ``optimize`` fp32, ``optimize`` bf16
(the ISA guard may keep fp32; then a forced-bf16 row shows what bf16 would cost). ``optimize``
returns the model itself; its no-grad calls run the frozen graph it keeps behind the forward, or
the eager rewrite when its own measurement found the graph slower (the "kept" note says which). With
``--backends`` also the eager-only rewrites and both freezing backends. All rows of a model are
timed interleaved (round robin), so contention from other processes hits every row alike.
At the end, runs ``bench/optimize_train.py`` (the training half) when it exists.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
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
from xlaunch.kernels.optimize.precision import bf16_unsupported_reason, isa_flags  # noqa: E402

TARGET_FP32, TARGET_BF16 = 1.5, 1.7


def bert_like() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=0.1,
                                       activation="gelu", batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)


def workload(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "cnn":
        return small_cnn().eval(), torch.randn(8, 3, 64, 64)
    if name == "bert":
        return bert_like().eval(), torch.randn(8, 128, 256)
    raise SystemExit(f"--models: unknown model {name!r} (cnn, bert)")


def under_autocast(model: nn.Module) -> Callable[[torch.Tensor], Any]:
    def run(x: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)
    return run


def build(label: str, make: Callable[[], Callable[[torch.Tensor], Any]]) -> tuple[Callable, float]:
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = make()
    seconds = time.perf_counter() - start
    for w in caught:
        if "xlaunch.optimize" in str(w.message):
            print(f"    [{label}] {w.message}")
    return fn, seconds


def time_interleaved(rows: dict[str, Callable], x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median ms per call; every round runs every row (slow rows once, fast rows several times)."""
    per_call: dict[str, float] = {}
    with torch.no_grad():
        for name, fn in rows.items():  # warm up and size the per-round repetitions
            fn(x)
            start = time.perf_counter()
            fn(x)
            per_call[name] = time.perf_counter() - start
        reps = {name: max(1, min(10, int(0.15 / max(t, 1e-4)))) for name, t in per_call.items()}
        samples: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(rounds):
            for name, fn in rows.items():
                for _ in range(reps[name]):
                    start = time.perf_counter()
                    fn(x)
                    samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in samples.items()}


def bench_model(name: str, rounds: int, backends: bool) -> dict[str, float]:
    model, x = workload(name)
    native_bf16 = bf16_unsupported_reason(isa_flags()) is None
    makers: dict[str, Callable[[], Callable]] = {
        "plain fp32": lambda: model,
        "plain bf16+autocast": lambda: under_autocast(model),
        "optimize fp32": lambda: optimize(model, sample_input=x),
        "optimize bf16": lambda: optimize(model, dtype=torch.bfloat16, sample_input=x),
    }
    if not native_bf16:
        makers["optimize bf16 (forced)"] = lambda: optimize(model, dtype=torch.bfloat16, sample_input=x,
                                                            force_bf16=True)
    if backends:
        makers["optimize fp32, eager only"] = lambda: optimize(model, weights_prepack=False)
        makers["optimize fp32, jit freeze"] = lambda: optimize(model, sample_input=x, freeze_backend="jit")
        makers["optimize fp32, inductor freeze"] = lambda: optimize(model, sample_input=x,
                                                                    freeze_backend="inductor")
    print(f"\n== {name}: input {tuple(x.shape)}, torch threads {torch.get_num_threads()}")
    rows = {}
    for label, make in makers.items():
        fn, seconds = build(label, make)
        report = getattr(fn, "_xlaunch_optimize_report", None)
        frozen = f", frozen with {report.frozen_with}" if report is not None and report.frozen_with else ""
        kept = f", kept {report.kept} (measured ms: " + ", ".join(
            f"{k} {v:.1f}" for k, v in report.timings_ms.items()) + ")" if report is not None and report.kept else ""
        print(f"  built {label:32s} in {seconds:6.2f} s{frozen}{kept}")
        rows[label] = fn
    ms = time_interleaved(rows, x, rounds)
    print(f"  {'row':32s} {'median ms':>10s} {'vs plain fp32':>14s} {'vs plain bf16':>14s}")
    for label, value in ms.items():
        print(f"  {label:32s} {value:10.2f} {ms['plain fp32'] / value:13.2f}x "
              f"{ms['plain bf16+autocast'] / value:13.2f}x")
    fp32_ratio = ms["plain fp32"] / ms["optimize fp32"]
    bf16_ratio = ms["plain bf16+autocast"] / ms["optimize bf16"]
    print(f"  optimize fp32 vs plain fp32: {fp32_ratio:.2f}x (target {TARGET_FP32}x: "
          f"{'met' if fp32_ratio >= TARGET_FP32 else 'not met'})")
    print(f"  optimize bf16 vs plain bf16: {bf16_ratio:.2f}x (target {TARGET_BF16}x: "
          f"{'met' if bf16_ratio >= TARGET_BF16 else 'not met'})"
          + ("" if native_bf16 else "  [no native bf16: 'optimize bf16' ran fp32]"))
    if "optimize bf16 (forced)" in ms:
        forced = ms["plain bf16+autocast"] / ms["optimize bf16 (forced)"]
        print(f"  optimize bf16 (forced) vs plain bf16: {forced:.2f}x")
    return ms


def matmul_gflops() -> float:
    """The machine's fp32 ceiling as torch sees it: a 1024^3 matmul."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(15):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 1024 ** 3 / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=names(("cnn", "bert")), default="cnn,bert")
    parser.add_argument("--rounds", type=COUNT, default=7)
    parser.add_argument("--backends", action="store_true", help="also compare the freezing backends")
    parser.add_argument("--no-train", action="store_true", help="skip bench/optimize_train.py")
    parser.add_argument("--threads", type=integer(0), default=0,
                        help="torch threads (default: torch's); 1 keeps OpenMP barrier stalls of a "
                             "loaded shared machine out of the ratios")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reason = bf16_unsupported_reason(isa_flags())
    print(this_machine())
    print(f"torch {torch.__version__}; native bf16: {'yes' if reason is None else 'no (' + reason + ')'}")
    print(f"fp32 matmul ceiling: {matmul_gflops():.0f} GFLOP/s")
    for name in args.models:
        bench_model(name, args.rounds, args.backends)
    train = REPO / "bench" / "optimize_train.py"
    if not args.no_train and train.exists():
        print(f"\n== training half: {train.relative_to(REPO)}", flush=True)
        threads = ["--threads", str(args.threads)] if args.threads else []     # the same threads as above
        subprocess.run([sys.executable, str(train), *threads], check=False)


if __name__ == "__main__":
    main()
