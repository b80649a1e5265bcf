"""Engines side by side, in one run per model and precision: eager, today's ``optimize`` (the
torch route), inductor, OpenVINO, ONNX Runtime and ``backend="auto"``, in fp32, bf16 and INT8; then
the first and the cached start of a program under ``xlaunch --ninstances 2 --auto-optimize``;
then cached-start times of ``optimize(backend="auto")`` alone (``--cached-start``).

    .venv/bin/python bench/engines.py [--models resnet50-b1,resnet50-b4,bert,mlp,export-fails]
                                      [--precisions fp32,bf16,int8] [--rounds 7] [--threads N]
                                      [--no-startup] [--startup-model resnet50-b1]
                                      [--cached-start] [--cached-start-models bert,resnet50-b4]
                                      [--cached-start-warm 3]

``--cached-start`` runs only that part (no engine tables, no ``xlaunch`` start-up): per model, one
fresh process with an empty ``XLAUNCH_CACHE_DIR`` (cold: builds and times every route), then
``--cached-start-warm`` fresh processes on the cache it wrote (warm: load the stored choice). Each
reports seconds from just before ``xlaunch.optimize(model, sample_input=x, backend="auto")`` to its
first result (the headline figure), and from process start (interpreter, imports, model build
included) to that result; warm figures are medians. The ratio cold/warm and the engine kept are
printed and go into the JSON summary under ``"cached-start/<model>"``. ``bert2`` is the encoder
with 2 layers instead of 4.

bf16 rows: eager under autocast, ``optimize(dtype=torch.bfloat16)`` per route and ``auto``, and
OpenVINO at its default precision (no hint: bf16 on a CPU with native bf16, f32 elsewhere),
labelled as such. INT8 rows: fp32 eager and ``quantize(mode="auto")`` (4 calibration batches),
with auto's own interleaved timing of every INT8 route and float variant it built (each route is
built once: building them again as rows would double a 3-minute run).

Models are written in plain torch (no torchvision), with random weights: ResNet-50 (batch 1 and
4, 3x224x224), a BERT-like encoder (4 layers, d 768, 12 heads, FFN 3072, batch 4, seq 128), an MLP
(1024-4096-4096-1024, batch 64) and a model whose export fails (Python control flow on a tensor's
value: both exporters refuse it, ``auto`` falls back). Every row of a model is timed round robin
(so load from other processes hits every row alike), with one untimed call before each sample
(the previous row's thread pool goes idle), medians over rounds and ratios to eager. A route that fell
back (its engine is not installed, its export fails) is not timed under its name: its row says why.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]           # the workers import bench.engines from REPO

from _args import COUNT, SECONDS, integer, names  # noqa: E402
from _engines_models import workload  # noqa: E402  (the start-up programs import it from here)
from _machine_bench import this_machine  # noqa: E402

from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

ROUTES = ("onnxruntime", "openvino", "inductor")


# -- timing ------------------------------------------------------------------------------------
def time_interleaved(rows: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of every row, per round (round robin; a 50 ms settle and one untimed call
    before each sample)."""
    per_call = {}
    with torch.no_grad():
        for name, run in rows.items():
            run()
            start = time.perf_counter()
            run()
            per_call[name] = time.perf_counter() - start
        reps = {name: max(1, min(20, int(0.2 / max(t, 1e-5)))) for name, t in per_call.items()}
        samples: dict[str, list[float]] = {name: [] for name in rows}
        for index in range(rounds):
            order = list(rows) if index % 2 == 0 else list(reversed(rows))
            for name in order:
                time.sleep(0.05)   # the previous row's threads (ORT, OpenMP, TBB) go idle
                rows[name]()
                start = time.perf_counter()
                for _ in range(reps[name]):
                    rows[name]()
                samples[name].append((time.perf_counter() - start) / reps[name])
    return samples


def build(label: str, make: Callable[[], nn.Module]) -> tuple[nn.Module, float, list[str]]:
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = make()
    return module, time.perf_counter() - start, [str(w.message) for w in caught if "xlaunch" in str(w.message)]


def bench_model(name: str, rounds: int) -> dict[str, Any]:
    model, x = workload(name)
    print(f"\n== {name}: input {tuple(x.shape)}, torch threads {torch.get_num_threads()}", flush=True)
    quiet = {"cache": False, "progress": False}
    makers: dict[str, Callable[[], nn.Module]] = {
        "eager": lambda: model,
        "optimize (torch)": lambda: optimize(model, sample_input=x),
        **{route: (lambda route=route: optimize(model, sample_input=x, backend=route, **quiet)) for route in ROUTES},
        "auto": lambda: optimize(model, sample_input=x, backend="auto", cache=False),
    }
    modules, rows, skipped = {}, {}, {}
    for label, make in makers.items():
        module, seconds, notes = build(label, make)
        report = getattr(module, "_xlaunch_engine_report", None)
        what = f" -> {report.backend}" if report is not None and report.backend != label else ""
        print(f"  built {label:18s} in {seconds:6.1f} s{what}", flush=True)
        for note in notes[:3]:
            print(f"      {note[:160]}")
        modules[label] = module
        if label in ROUTES and fell_back(label, report, skipped):
            continue                     # its row would time the route it fell back to, under this one's name
        rows[label] = lambda module=module: module(x)
    auto_report = modules["auto"]._xlaunch_engine_report
    print("  auto's report:\n    " + str(auto_report).replace("\n", "\n    "))
    samples = time_interleaved(rows, rounds)
    ms = {label: statistics.median(values) * 1e3 for label, values in samples.items()}
    spread = {label: (min(values) * 1e3, max(values) * 1e3) for label, values in samples.items()}
    print(f"  {'row':18s} {'median ms':>10s} {'min..max ms':>18s} {'vs eager':>9s}")
    for label in makers:
        if label in skipped:
            print(f"  {label:18s} {'-':>10s} {'not timed: ' + skipped[label][:120]}")
            continue
        low, high = spread[label]
        print(f"  {label:18s} {ms[label]:10.2f} {low:8.1f}..{high:<8.1f} {ms['eager'] / ms[label]:8.2f}x")
    singles = {label: ms[label] for label in ("eager", "optimize (torch)", *ROUTES) if label in ms}
    best = min(singles, key=singles.__getitem__)
    print(f"  auto kept {auto_report.backend}; auto vs best single route ({best}): {singles[best] / ms['auto']:.2f}x; "
          f"auto vs eager: {ms['eager'] / ms['auto']:.2f}x")
    return {"ms": ms, "kept": auto_report.backend, "best": best, "not_timed": skipped}


def fell_back(label: str, report: Any, skipped: dict[str, str]) -> bool:
    """Whether the module built for route ``label`` runs another route (its engine report says which, and
    why); the reason goes to ``skipped`` and is printed."""
    route = label.split()[0]
    if report is None or report.backend == route:
        return False
    why = report.routes[route].skipped if route in report.routes and report.routes[route].skipped else report.reason
    skipped[label] = f"{route} fell back to {report.backend} ({why})"
    print(f"      ({skipped[label][:200]})", flush=True)
    return True


# -- start-up under xlaunch --------------------------------------------------------------------
STARTUP_SCRIPT = r"""
import json, os, sys, time
import psutil
sys.path.insert(0, {repo!r})
import torch
from bench.engines import workload
model, x = workload({model!r})
with torch.no_grad():
    model(x)
ready = time.time() - psutil.Process().create_time()
print(json.dumps({{"ready_s": ready}}), flush=True)
"""


def startup(model: str, budget: str) -> None:
    """First and second run of a program under ``xlaunch --ninstances 2 --auto-optimize``, one
    fresh cache: seconds from each instance's start to its first result."""
    print(f"\n== start-up: xlaunch --ninstances 2 --ncores-per-instance 1 --auto-optimize ({model}, "
          f"XLAUNCH_AUTO_OPTIMIZE_BUDGET={budget})", flush=True)
    with tempfile.TemporaryDirectory(prefix="xlaunch-bench-") as folder:
        script = Path(folder) / "program.py"
        script.write_text(STARTUP_SCRIPT.format(repo=str(REPO), model=model))
        env = {**os.environ, "XLAUNCH_CACHE_DIR": str(Path(folder) / "cache"), "XLAUNCH_AUTO_OPTIMIZE_BUDGET": budget}
        env.pop("PYTHONPATH", None)
        runs = []
        for label in ("first start (builds)", "second start (cache)"):
            start = time.perf_counter()
            result = subprocess.run([sys.executable, "-m", "xlaunch", "-q", "--ninstances", "2",
                                     "--ncores-per-instance", "1", "--auto-optimize", "--auto-optimize-verbose",
                                     str(script)], capture_output=True, text=True, env=env, cwd=folder)
            wall = time.perf_counter() - start
            ready = [json.loads(line.split("] ", 1)[1])["ready_s"] for line in result.stdout.splitlines()
                     if '"ready_s"' in line]
            kept = [line.split("optimized: ", 1)[1] for line in (result.stdout + result.stderr).splitlines()
                    if "optimized: backend" in line]
            if result.returncode != 0 or len(ready) != 2:
                print(f"  {label}: failed (exit {result.returncode})\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
                return
            runs.append(max(ready))
            print(f"  {label:22s}: first result after {ready[0]:6.1f} s / {ready[1]:6.1f} s "
                  f"(instances), launcher wall {wall:6.1f} s")
            for line in kept:
                print(f"      {line[:200]}")
        print(f"  second start {runs[0] / runs[1]:.1f}x faster to first result (slower instance)")


# -- cached start: optimize(backend="auto") in a fresh process, empty cache vs the cache it wrote ---
CACHED_START_SCRIPT = r"""
import json, sys, time
import psutil
created = psutil.Process().create_time()
sys.path.insert(0, {repo!r})
import torch
if {threads}:
    torch.set_num_threads({threads})
import xlaunch
from bench.engines import workload
model, x = workload({model!r})
start = time.time()
fast = xlaunch.optimize(model, sample_input=x, backend="auto")
with torch.no_grad():
    fast(x)
end = time.time()
report = fast._xlaunch_engine_report
print("CACHED_START " + json.dumps({{"optimize_to_result_s": end - start, "process_to_result_s": end - created,
                                    "backend": report.backend, "cache": report.cache}}), flush=True)
"""


def cached_start(model: str, warm_runs: int, threads: int) -> dict[str, Any]:
    """Seconds to the first result of ``optimize(backend="auto")`` in a fresh process: with an
    empty cache (cold), then median of ``warm_runs`` fresh processes on the cache the first wrote."""
    print(f"\n== cached start: {model}, optimize(model, sample_input=x, backend='auto') in fresh processes, "
          f"1 cold + {warm_runs} warm", flush=True)
    with tempfile.TemporaryDirectory(prefix="xlaunch-bench-") as folder:
        script = Path(folder) / "cached_start.py"
        script.write_text(CACHED_START_SCRIPT.format(repo=str(REPO), model=model, threads=threads))
        env = {**os.environ, "XLAUNCH_CACHE_DIR": str(Path(folder) / "cache")}
        env.pop("PYTHONPATH", None)
        runs = []
        for index in range(1 + warm_runs):
            label = "cold (empty cache)" if index == 0 else f"warm {index} (cache)"
            result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=folder)
            lines = [line for line in result.stdout.splitlines() if line.startswith("CACHED_START ")]
            if result.returncode != 0 or not lines:
                print(f"  {label}: failed (exit {result.returncode})\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
                return {"failed": label}
            run = json.loads(lines[-1].split(" ", 1)[1])
            runs.append(run)
            print(f"  {label:20s}: optimize -> first result {run['optimize_to_result_s']:6.2f} s, process start -> "
                  f"first result {run['process_to_result_s']:6.2f} s; {run['backend']}, cache {run['cache']}",
                  flush=True)
    cold, warm = runs[0], runs[1:]
    out = {"cold_optimize_s": cold["optimize_to_result_s"], "cold_process_s": cold["process_to_result_s"],
           "warm_optimize_s": statistics.median(r["optimize_to_result_s"] for r in warm),
           "warm_process_s": statistics.median(r["process_to_result_s"] for r in warm),
           "kept": cold["backend"], "warm_kept": sorted({r["backend"] for r in warm}),
           "warm_cache": sorted({r["cache"] for r in warm})}
    out["ratio_optimize"] = out["cold_optimize_s"] / out["warm_optimize_s"]
    out["ratio_process"] = out["cold_process_s"] / out["warm_process_s"]
    print(f"  cold/warm: {out['ratio_optimize']:.1f}x from just before optimize(), {out['ratio_process']:.1f}x from "
          f"process start (warm = median of {len(warm)}); kept {out['kept']}, warm runs loaded "
          f"{', '.join(out['warm_kept'])} (cache {', '.join(out['warm_cache'])})", flush=True)
    return out


def rel_error(reference: torch.Tensor, out: torch.Tensor) -> float:
    return ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def openvino_default(model: nn.Module, x: torch.Tensor) -> Any:
    """OpenVINO with no precision hint: its default (bf16 on a CPU with native bf16)."""
    from xlaunch.kernels.optimize.engines.routes.openvino_route import CompiledRunner, convert
    from xlaunch.kernels.optimize.engines.sample import Sample

    sample = Sample(model, x)
    threads = torch.get_num_threads()
    return CompiledRunner(convert(model, sample), sample, threads,
                          config={"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"})


def bench_bf16(name: str, rounds: int) -> dict[str, Any]:
    model, x = workload(name)
    bf16 = torch.bfloat16
    print(f"\n== {name} bf16: input {tuple(x.shape)}, torch threads {torch.get_num_threads()}", flush=True)
    quiet = {"cache": False, "progress": False}

    def autocast_eager(inputs: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=bf16):
            return model(inputs)

    makers: dict[str, Callable[[], Any]] = {
        "eager fp32": lambda: model,
        "eager autocast": lambda: autocast_eager,
        "optimize (torch)": lambda: optimize(model, dtype=bf16, sample_input=x),
        "inductor": lambda: optimize(model, dtype=bf16, sample_input=x, backend="inductor", **quiet),
        "openvino bf16": lambda: optimize(model, dtype=bf16, sample_input=x, backend="openvino", **quiet),
        "openvino default": lambda: openvino_default(model, x),
        "auto": lambda: optimize(model, dtype=bf16, sample_input=x, backend="auto", cache=False),
    }
    rows, errors, skipped = {}, {}, {}
    with torch.no_grad():
        reference = model(x)
    for label, make in makers.items():
        try:
            module, seconds, notes = build(label, make)
        except ImportError as error:     # openvino default without OpenVINO: the other rows still run
            skipped[label] = f"{type(error).__name__}: {error}"
            print(f"  {label:18s} not built: {skipped[label][:200]}", flush=True)
            continue
        report = getattr(module, "_xlaunch_engine_report", None)
        what = f" -> {report.backend}" if report is not None and label in ("auto", "inductor", "openvino bf16") else ""
        with torch.no_grad():
            errors[label] = rel_error(reference, module(x))
        print(f"  built {label:18s} in {seconds:6.1f} s{what}; max rel error vs fp32 eager {errors[label]:.1e}", flush=True)
        if label == "auto":
            print("  auto's report:\n    " + str(report).replace("\n", "\n    "))
        if label not in ("inductor", "openvino bf16") or not fell_back(label, report, skipped):
            rows[label] = lambda module=module: module(x)
    samples = time_interleaved(rows, rounds)
    ms = {label: statistics.median(values) * 1e3 for label, values in samples.items()}
    peers = {k: v for k, v in ms.items() if k not in ("auto", "eager fp32")}
    best = min(peers, key=peers.__getitem__)
    print(f"  {'row':18s} {'median ms':>10s} {'vs best peer':>12s}")
    for label in makers:
        print(f"  {label:18s} {'-':>10s} not timed: {skipped[label][:120]}" if label in skipped else
              f"  {label:18s} {ms[label]:10.2f} {ms[best] / ms[label]:11.2f}x")
    print(f"  bf16 auto vs best bf16 route ({best}): {ms[best] / ms['auto']:.2f}x")
    return {"ms": ms, "best": best, "errors": errors, "not_timed": skipped}


def bench_int8(name: str, rounds: int) -> dict[str, Any]:
    from xlaunch.kernels.quantize.api import quantize

    model, x = workload(name)
    print(f"\n== {name} INT8: input {tuple(x.shape)}, torch threads {torch.get_num_threads()}", flush=True)
    gen = torch.Generator().manual_seed(1)
    calibration = [(torch.randn(x.shape, generator=gen),) for _ in range(4)]
    quantized, seconds, notes = build("quantize auto", lambda: quantize(model, (x,), calibration=calibration, rounds=rounds))
    report = quantized.report
    print(f"  quantize(mode='auto') built in {seconds:.1f} s, kept {quantized.mode}")
    print("  its report:\n    " + str(report).replace("\n", "\n    "))
    timed = {k: r.ms for k, r in report.routes.items() if r.ms is not None}
    int8 = {k: v for k, v in timed.items() if k in ("static", "dynamic", "weight_only", "openvino_static",
                                                    "onnxruntime_static")
            and (report.routes[k].rel_error or 0) <= 0.1}
    samples = time_interleaved({"eager fp32": lambda: model(x), "quantize auto": lambda: quantized(x)}, rounds)
    ms = {label: statistics.median(values) * 1e3 for label, values in samples.items()}
    for label, value in ms.items():
        print(f"  {label:18s} {value:10.2f} ms (bench timing)")
    if int8:
        best = min(int8, key=int8.__getitem__)
        print(f"  quantize auto ({quantized.mode}, {timed.get(quantized.mode, float('nan')):.2f} ms in auto's timing) "
              f"vs best INT8 route ({best}, {int8[best]:.2f} ms): {int8[best] / timed.get(quantized.mode, float('nan')):.2f}x")
    return {"ms": ms, "auto_timing": timed, "kept": quantized.mode}


def machine() -> str:
    """The machine as every bench names it (the CPUs this process may use, the ISA), and the engines' versions."""
    from importlib import metadata

    versions = []
    for package in ("torch", "onnxruntime", "openvino"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} -")
    return f"{this_machine()}; Python {platform.python_version()}; {', '.join(versions)}"


def main(argv: list[str] | None = None) -> None:
    benches = {"fp32": bench_model, "bf16": bench_bf16, "int8": bench_int8}
    models = names(("resnet50-b<batch>", "bert", "bert2", "mlp", "export-fails"),     # what workload() builds
                   re.compile(r"resnet50-b[1-9][0-9]*|bert2?|mlp|export-fails").fullmatch)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=models, default="resnet50-b1,resnet50-b4,bert,mlp,export-fails")
    parser.add_argument("--precisions", type=names(tuple(benches)), default="fp32", help="comma list of fp32, bf16, int8")
    parser.add_argument("--rounds", type=COUNT, default=7)
    parser.add_argument("--threads", type=integer(0), default=0, help="torch threads (default: torch's)")
    parser.add_argument("--no-startup", action="store_true")
    parser.add_argument("--startup-model", type=models, default="resnet50-b1")
    parser.add_argument("--startup-budget", type=SECONDS, default=300.0, help="XLAUNCH_AUTO_OPTIMIZE_BUDGET, seconds")
    parser.add_argument("--cached-start", action="store_true",
                        help="run only the cached-start times (cold vs warm optimize(backend='auto'))")
    parser.add_argument("--cached-start-models", type=models, default="bert,resnet50-b4")
    parser.add_argument("--cached-start-warm", type=COUNT, default=3, help="warm processes (median)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    print(f"load average at start: {Path('/proc/loadavg').read_text().split()[:3]}")
    summary = {}
    for name in ([] if args.cached_start else args.models):
        for precision in args.precisions:
            summary[f"{name}/{precision}"] = benches[precision](name, args.rounds)
            print(f"  load average: {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    if not (args.no_startup or args.cached_start):
        for model in args.startup_model:
            startup(model, f"{args.startup_budget:g}")
    if args.cached_start:
        for name in args.cached_start_models:
            summary[f"cached-start/{name}"] = cached_start(name, args.cached_start_warm, args.threads)
            print(f"  load average: {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    print(f"\nload average at end: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
