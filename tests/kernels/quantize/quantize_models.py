"""The models the quantize tests share (a CNN, an MLP, a transformer encoder) and the one
``auto`` quantization per model that the route tests read."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from xlaunch.kernels.quantize import engine_saved, policy
from xlaunch.kernels.quantize.api import QuantizeWarning, quantize

def skip_module_without_torchao() -> None:
    """Skip the calling test module when torchao (the PT2E routes' passes) cannot be imported."""
    from xlaunch.kernels.quantize import routes

    try:
        routes.import_torchao()
    except ImportError:
        pytest.skip("torchao is not installed (scripts/setup.sh installs it)", allow_module_level=True)


# Bounds: max |int8 - fp32| / max |fp32| over the calibration inputs, and argmax agreement.
# Measured here (AVX2, reduce_range): static/dynamic 0.005-0.03, weight-only 0.005-0.01.
MAX_ERROR = {"static": 0.08, "dynamic": 0.08, "weight_only": 0.03}
# The other engines' static INT8 (NNCF's leaves the rest at OpenVINO's default precision: bf16 on a
# CPU with native bf16). Measured on a Zen 4 (VNNI): 0.007-0.02 on the CNN.
MAX_ERROR.update({"openvino_static": 0.08, "onnxruntime_static": 0.08})
MIN_AGREEMENT = 0.9
# Every INT8 route a saved model can hold (test_quantize_saved.py, save_then_load).
SAVED_ROUTES = ("static", "dynamic", "weight_only", *engine_saved.ENGINES)
BENCH = Path(__file__).resolve().parents[3] / "bench"


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


SHAPES = {"cnn": (8, 3, 16, 16), "mlp": (32, 64), "encoder": (8, 16, 64)}
MODELS = {"cnn": CNN, "mlp": MLP, "encoder": Encoder}


def make(name: str) -> tuple[nn.Module, torch.Tensor, list[tuple]]:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    gen = torch.Generator().manual_seed(1)
    example = torch.randn(SHAPES[name], generator=gen)
    calibration = [(torch.randn(SHAPES[name], generator=gen),) for _ in range(4)]
    return model, example, calibration



def residual_blocks() -> tuple[nn.Module, torch.Tensor, list[tuple]]:
    """A stem conv and two of bench/engines.py's ResNet-50 bottlenecks (one ``self.relu`` called
    three times per block, as torchvision's; in bench/_engines_models.py), tiny: the pattern that
    broke the PT2E routes."""
    spec = importlib.util.spec_from_file_location("bench_engines_models", BENCH / "_engines_models.py")
    engines = sys.modules.get(spec.name)
    if engines is None:
        engines = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = engines
        spec.loader.exec_module(engines)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), engines.Bottleneck(16, 4, 1),
                          engines.Bottleneck(16, 8, 2)).eval()
    gen = torch.Generator().manual_seed(1)
    example = torch.randn(2, 3, 8, 8, generator=gen)
    return model, example, [(torch.randn(2, 3, 8, 8, generator=gen),) for _ in range(2)]


# What the shared auto fixtures build: the torch INT8 routes (the other engines' INT8 and the bf16
# variant cost seconds of builds per model; tests/kernels/quantize/test_quantize_engines.py
# builds them once, on the MLP).
FIXTURE_ROUTES = policy.TORCH_INT8_ROUTES
# The fixtures' auto timing: interleaved rounds (7 by default) and the fp32 engines optimize() may
# keep as the float variant (ONNX Runtime and OpenVINO by default). check_auto reads the times auto
# measured, so 3 rounds and one engine (ONNX Runtime, the quicker build: 1.4 s against 13.7 s for
# OpenVINO on the CNN, AVX2 VM) test the same promise; tests/kernels/optimize covers optimize()'s
# choice among engines.
FIXTURE_ROUNDS = 3
FIXTURE_FP32_BACKENDS = ["onnxruntime"]
# The models whose auto also builds that fp32 optimize() variant (2.1 s of CPU on the MLP, 4.3 s on
# the CNN, 8.3 s on the encoder: ONNX export and optimize's own timing; AVX2 VM). The CNN's INT8
# routes are compared with fp32 eager (what its tests name): optimize()'s engines on a convolution
# are tests/kernels/optimize/test_engines.py's; the encoder is the only attention model exported.
FIXTURE_OPTIMIZE = ("mlp", "encoder")


class TimedLines(io.TextIOBase):
    """A stderr that keeps each line with the seconds since it was made (not a terminal)."""

    def __init__(self) -> None:
        super().__init__()
        self.start, self.lines, self._part = time.perf_counter(), [], ""

    def write(self, text: str) -> int:
        self._part += text
        while "\n" in self._part:
            line, self._part = self._part.split("\n", 1)
            self.lines.append((time.perf_counter() - self.start, line))
        return len(text)


def auto_quantized(names: list[str]) -> dict:
    """One auto quantization per named model: builds every torch INT8 route and times them with
    fp32. Each result: (model, example, calibration, quantized, progress lines with their times,
    {route: the routes.Built that auto built}, how many times auto exported the float model)."""
    import pytest

    from xlaunch.kernels.quantize import api

    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as tests/conftest.py's one_torch_thread, for the module's fixtures
    try:
        for name in names:
            results[name] = _auto_quantized(name, api, pytest)
    finally:
        torch.set_num_threads(threads)
    return results


def _auto_quantized(name: str, api, pytest) -> tuple:
    """One model's auto quantization, with one torch thread: auto's and optimize()'s timing runs
    each variant for a set time, and on a shared 2-vCPU machine a second thread doubles the CPU
    that costs (and waits on the first whenever another process takes a CPU)."""
    from xlaunch.kernels.quantize import routes

    model, example, calibration = make(name)
    builds: dict = {}
    exports: list = []
    export = routes.export
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(routes, "export", lambda *args: exports.append(args) or export(*args))
        warnings.simplefilter("ignore", QuantizeWarning)
        patch.setattr(api, "FP32_BACKENDS", FIXTURE_FP32_BACKENDS)
        if name not in FIXTURE_OPTIMIZE:   # fp32 eager is the float variant
            patch.setattr(api, "_optimized", lambda *args, **kwargs: None)
        build = api._build
        patch.setattr(api, "_build", lambda route, *args: builds.setdefault(route, build(route, *args)))
        stderr = TimedLines()
        with contextlib.redirect_stderr(stderr):
            quantized = quantize(model, (example,), calibration=calibration, consider=FIXTURE_ROUTES,
                                 rounds=FIXTURE_ROUNDS)
        return model, example, calibration, quantized, stderr.lines, builds, len(exports)


def check_progress(quantized, lines: list[tuple[float, str]]) -> None:
    """quantize(mode="auto") says what it does under its own name from its first second: the
    reference, each route it builds, the float variant, the timing and the choice."""
    ours = [(t, line) for t, line in lines if line.startswith("xlaunch.quantize: ")]
    assert ours and ours[0][0] < 1.0 and lines[0][1] == ours[0][1], lines[:3]
    text = "\n".join(line for _, line in ours)
    for route, result in quantized.report.routes.items():
        if route in policy.INT8_ROUTES and result.skipped is None:
            assert f"xlaunch.quantize: building {route} INT8: relative error {result.rel_error:.4f}" in text, text
    assert "xlaunch.quantize: timing " in text and "xlaunch.quantize: kept " in text, text
    if policy.FP32_OPTIMIZE in quantized.report.routes:   # optimize()'s own lines follow ours, under its name
        assert f"xlaunch.quantize: {policy.FP32_OPTIMIZE}: " in text, text


def skip_without_inductor() -> None:
    """Skip, saying why, where inductor cannot build C++ in this installation (torch under a path with a
    space): the static and dynamic routes and optimize's inductor route compile through it."""
    import pytest

    from xlaunch.kernels.optimize.freeze import inductor_blocker

    reason = inductor_blocker()
    if reason is not None:
        pytest.skip(reason)


def check_route(result, route: str) -> None:
    if route in ("static", "dynamic"):
        skip_without_inductor()
    assert result.skipped is None, result.skipped
    assert result.rel_error is not None and result.rel_error <= MAX_ERROR[route], result
    assert result.argmax_agreement is not None and result.argmax_agreement >= MIN_AGREEMENT, result
    assert result.ms is not None and result.ms > 0


def check_auto(model, example, _calibration, quantized, *_progress) -> None:
    report = quantized.report
    times = {k: v.ms for k, v in report.routes.items() if v.ms is not None}
    best_fp32 = min(times.get(name, float("inf")) for name in policy.FLOAT_VARIANTS)
    if quantized.mode in ("fp32", "bf16"):   # the fastest float variant, nothing labelled int8
        assert report.quantized == [] and report.rel_error is None
    else:
        assert times[quantized.mode] * policy.DEFAULT_SPEEDUP_MARGIN <= best_fp32
        assert report.quantized and report.rel_error <= policy.DEFAULT_MAX_ERROR
    # The returned model is the variant that was measured: INT8 ops in its program exactly when
    # an INT8 route was picked. (A fresh timing here would only re-measure the machine's noise.)
    if quantized.mode not in policy.ENGINE_INT8_ROUTES:   # those run another engine's INT8 model
        targets = {str(n.target) for n in quantized.program.graph.nodes if n.op == "call_function"}
        has_int8 = any("quantize_per" in t or "access_subclass_inner_tensor" in t for t in targets)
        assert has_int8 == (quantized.mode not in ("fp32", "bf16")), (quantized.mode, sorted(targets))
    with torch.no_grad():
        ref, out = model(example), quantized(example)
    assert (ref - out).abs().max() <= policy.DEFAULT_MAX_ERROR * ref.abs().max()


@functools.cache   # one build a session: test_quantize.py and test_quantize_saved.py read it, never change it
def saved_variants() -> dict:
    """route -> (quantized tiny MLP, input), or the reason it cannot be built here, for every INT8
    route: the engine routes and weight-only through ``quantize(mode=...)`` (what a user runs), the
    PT2E routes built without their compile (their program is compared eagerly, which is what the
    file carries; the compiled ones are the saved ``quantize()`` results of test_quantize.py); and
    ``"bf16"``, the bf16 float variant ``auto`` keeps (:func:`bf16_kept_by_auto`)."""
    from xlaunch.kernels.quantize import engine_routes, routes
    from xlaunch.kernels.quantize.api import QuantizedModule, QuantizeReport

    model, example, calibration = make("mlp")
    calibration = calibration[:2]
    try:
        routes.import_torchao()
        torchao = None
    except ImportError as exc:
        torchao = str(exc)
    built: dict = {}
    for route in SAVED_ROUTES:
        missing = engine_routes.missing(route) if route in engine_saved.ENGINES else torchao
        if missing is not None:
            built[route] = missing
        elif route in ("static", "dynamic"):
            build = routes.build_pt2e(model, (example,), calibration if route == "static" else [(example,)],
                                      dynamic=route == "dynamic", reduce_range=True)
            program = routes.export(build.program_source, (example,))
            eager = program.module()
            built[route] = (QuantizedModule(lambda *args, run=eager: run(*args), program, route,
                                            QuantizeReport(mode=route, requested=route)), example)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", QuantizeWarning)
                built[route] = (quantize(model, (example,), calibration=calibration, mode=route), example)
    built["bf16"] = torchao or bf16_kept_by_auto()
    return built


def bf16_kept_by_auto() -> tuple[Any, torch.Tensor]:
    """What ``quantize(mode="auto", consider=["weight_only", "bf16"])`` returns when its bf16 float
    variant times fastest (a stand-in measurement, on any CPU): mode ``"bf16"``, and its input. The
    MLP is smaller than :func:`make`'s: optimize() times its engines for the float variants."""
    from unittest import mock

    from xlaunch.kernels.quantize import api

    example = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def measure(variants: dict, example: Any, rounds: int) -> dict:
        return {name: 1.0 if name == policy.BF16_OPTIMIZE else 10.0 for name in variants}

    with mock.patch.object(api, "_native_bf16", lambda: True), mock.patch.object(api, "measure", measure), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(tiny_mlp(), (example,), mode="auto", consider=["weight_only", "bf16"],
                             progress=False)
    assert quantized.mode == "bf16", quantized.mode
    return quantized, example


def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


LOAD_SCRIPT = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from xlaunch.kernels.quantize import engine_saved, load_quantized
cases, engines = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for path, mode in engines:   # the engine made unimportable first: one ImportError naming the extra
    needs = engine_saved.NEEDS[engine_saved.ENGINES[mode]]
    kept = {name: sys.modules.get(name) for name in needs}
    sys.modules.update({name: None for name in needs})
    try:
        load_quantized(path)
        raise SystemExit(f"{path}: loaded without its engine")
    except ImportError as exc:
        print("missing:", str(exc))
    for name, module in kept.items():
        if module is None:
            del sys.modules[name]
        else:
            sys.modules[name] = module
for path, io_path, compiled in cases:
    x, expected, mode, how = torch.load(io_path)
    model = load_quantized(path)
    assert model.mode == mode, (path, model.mode, mode)
    if not compiled:   # the file's program, run eagerly (PT2E), or the model as loaded
        with torch.no_grad():
            out = model(x) if mode not in ("static", "dynamic") else model.program.module()(x)
            error = (out - expected).abs().max().item() / expected.abs().max().item()
            # bf16: the saved float program under autocast against optimize()'s bf16 engine
            assert error <= (2e-2 if mode == "bf16" else 1e-5) and out.dtype == expected.dtype, (path, error)
            if mode not in ("static", "dynamic"):
                assert model(x[:3]).shape == (3, *expected.shape[1:]), mode   # another batch size
        print("ok", path, error)
        continue
    # compiled as the saved model was, before any call (the encoder's unbacked compile fails: not again)
    assert getattr(model._runner, "how", None) == how, (path, how)
    out = model(x)
    error = (out - expected).abs().max().item() / expected.abs().max().item()
    # bf16 (auto may keep it): the saved program under autocast against optimize()'s bf16 engine, two bf16 steps
    assert error < (1e-2 if mode == "bf16" else 1e-4), (path, mode, error)
    graphs = counters["stats"]["unique_graphs"]
    # one compile serves every batch size (no recompile per new batch); a batch compiled "dynamic" (where an
    # unbacked one cannot work, e.g. auto keeping the dynamic route of a CNN) compiles batch 1 once more, and
    # dynamo may bound its range at another size of the model (the test CNN's 16 x 16 images: batches 2-15)
    for batch in ((1, 3, 16) if how != "dynamic" else (3, 5)):
        rows = x.repeat(16, *[1] * (x.dim() - 1))[:batch]
        assert model(rows).shape[0] == batch
    assert counters["stats"]["unique_graphs"] == graphs, (path, mode, how, graphs, counters["stats"]["unique_graphs"])
    print("ok", path, error)
"""


def save_then_load(tmp_path, compiled: dict, saved: dict) -> None:
    """Save each (quantized, input), load all of them in one fresh process (no model class
    there; each process imports torch and torchao: seconds): the same outputs, nothing printed,
    nothing written. ``compiled`` are run as loaded, with one compile for every batch size;
    ``saved`` (:func:`saved_variants`) are compared eagerly, and each engine route is first
    loaded with its engine unimportable: one ImportError naming the extra."""
    cases, engines = [], []
    labelled = [(f"compiled_{k}", v, True) for k, v in compiled.items()] + [(k, v, False) for k, v in saved.items()]
    for label, (q, x), run_compiled in labelled:
        path, io_path = tmp_path / f"{label}.pt2", tmp_path / f"{label}.io"
        q.save(str(path))
        with torch.no_grad():
            torch.save((x, q(x), q.mode, getattr(q._runner, "how", None)), io_path)
        cases.append((str(path), str(io_path), run_compiled))
        if q.mode in engine_saved.ENGINES:
            engines.append((str(path), q.mode))
    before = sorted(p.name for p in tmp_path.iterdir())
    # The child cannot import this test module: the models' classes are not available there.
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, json.dumps(cases), json.dumps(engines)],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("ok ")] == [path for path, _, _ in cases]
    missing = [line for line in lines if line.startswith("missing:")]
    assert len(missing) == len(engines) and len(lines) == len(cases) + len(engines), lines
    for line, (_, route) in zip(missing, engines):
        assert f'pip install "xlaunch[{engine_saved.ENGINES[route]}]"' in line and route in line, line
    from native_kernels import without_unbuilt_kernels_warning

    # loading and compiling print nothing (torchao's CUDA-library notices are muted)
    assert without_unbuilt_kernels_warning(proc.stderr) == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before   # loading wrote nothing
