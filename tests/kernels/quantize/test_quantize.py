"""quantize(): every INT8 route on a CNN, an MLP and a transformer encoder, compiled and run for
real; accuracy bounds, auto never slower than fp32 eager, save/load in a fresh process, errors.

Compiles are slow: one ``auto`` build per model (it builds and measures every route) is shared by
the route tests through module-scoped fixtures.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.quantize import routes as quantize_routes  # noqa: E402

try:
    quantize_routes.import_torchao()
except ImportError:
    pytest.skip("torchao is not installed (scripts/setup.sh installs it)", allow_module_level=True)

import xlaunch  # noqa: E402
import xlaunch.kernels  # noqa: E402
from xlaunch.kernels.quantize.api import (  # noqa: E402
    QuantizeWarning, load_quantized, quantize)
from xlaunch.kernels.quantize import policy as policy  # noqa: E402

pytestmark = pytest.mark.torch

# Bounds: max |int8 - fp32| / max |fp32| over the calibration inputs, and argmax agreement.
# Measured here (AVX2, reduce_range): static/dynamic 0.005-0.03, weight-only 0.005-0.01.
MAX_ERROR = {"static": 0.08, "dynamic": 0.08, "weight_only": 0.03}
MIN_AGREEMENT = 0.9


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


@pytest.fixture(scope="module")
def auto_results() -> dict:
    """One auto quantization per model: builds every INT8 route and times them with fp32."""
    results = {}
    for name in MODELS:
        model, example, calibration = make(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QuantizeWarning)
            results[name] = (model, example, calibration, quantize(model, (example,), calibration=calibration))
    return results


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("route", policy.INT8_ROUTES)
def test_each_route_keeps_accuracy(auto_results: dict, name: str, route: str) -> None:
    result = auto_results[name][3].report.routes[route]
    assert result.skipped is None, result.skipped
    assert result.rel_error is not None and result.rel_error <= MAX_ERROR[route], result
    assert result.argmax_agreement is not None and result.argmax_agreement >= MIN_AGREEMENT, result
    assert result.ms is not None and result.ms > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_is_never_slower_than_fp32_eager(auto_results: dict, name: str) -> None:
    model, example, _, quantized = auto_results[name]
    report = quantized.report
    times = {k: v.ms for k, v in report.routes.items() if v.ms is not None}
    best_fp32 = min(times[policy.FP32_EAGER], times.get(policy.FP32_OPTIMIZE, float("inf")))
    if quantized.mode == "fp32":   # the faster of fp32 eager and optimize(), nothing labelled int8
        assert report.quantized == [] and report.rel_error is None
    else:
        assert times[quantized.mode] * policy.DEFAULT_SPEEDUP_MARGIN <= best_fp32
        assert report.quantized and report.rel_error <= policy.DEFAULT_MAX_ERROR
    # The returned model is the variant that was measured: INT8 ops in its program exactly when
    # an INT8 route was picked. (A fresh timing here would only re-measure the machine's noise.)
    targets = {str(n.target) for n in quantized.program.graph.nodes if n.op == "call_function"}
    has_int8 = any("quantize_per" in t or "access_subclass_inner_tensor" in t for t in targets)
    assert has_int8 == (quantized.mode != "fp32"), (quantized.mode, sorted(targets))
    with torch.no_grad():
        ref, out = model(example), quantized(example)
    assert (ref - out).abs().max() <= policy.DEFAULT_MAX_ERROR * ref.abs().max()


def test_auto_report_names_every_variant(auto_results: dict) -> None:
    report = auto_results["mlp"][3].report
    assert {policy.FP32_EAGER, policy.FP32_OPTIMIZE, *policy.INT8_ROUTES} <= set(report.routes)
    assert report.reduce_range == (report.isa_int8_dot is None)
    text = str(report)
    assert "fp32_eager" in text and "static" in text
    json.dumps(report.to_dict())


@pytest.fixture(scope="module")
def static_mlp() -> tuple:
    model, example, calibration = make("mlp")
    quantized = quantize(model, example, calibration=calibration, mode="static")
    return model, example, calibration, quantized


def test_static_mode_quantizes_every_linear(static_mlp: tuple) -> None:
    model, example, calibration, quantized = static_mlp
    assert quantized.mode == "static"
    assert quantized.report.quantized == ["net.0", "net.2", "net.4"]
    assert quantized.report.kept_fp32 == {}
    with torch.no_grad():
        ref, out = model(example), quantized(example)
    assert (ref - out).abs().max() <= MAX_ERROR["static"] * ref.abs().max()
    assert quantized.report.routes[policy.FP32_EAGER].ms > 0 and quantized.report.routes["static"].ms > 0


@pytest.fixture(scope="module")
def weight_only_encoder() -> tuple:
    """The encoder quantized weight-only, with the warnings that call gave (compiled once)."""
    model, example, calibration = make("encoder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = quantize(model, example, mode="weight_only")
    return model, example, quantized, [w for w in caught if issubclass(w.category, QuantizeWarning)]


def test_weight_only_reports_what_stays_fp32(weight_only_encoder: tuple) -> None:
    _, _, quantized, caught = weight_only_encoder
    assert len([w for w in caught if "stay fp32" in str(w.message)]) == 1
    assert [w.filename for w in caught if "stay fp32" in str(w.message)] == [__file__]
    report = quantized.report
    assert report.quantized == ["encoder.layers.0.linear1", "encoder.layers.0.linear2", "head"]
    assert "MultiheadAttention" in report.kept_fp32["encoder.layers.0.self_attn"]
    assert report.rel_error <= MAX_ERROR["weight_only"]


LOAD_SCRIPT = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from xlaunch.kernels import load_quantized
for path, io_path in json.loads(sys.argv[1]):
    x, expected, mode = torch.load(io_path)
    model = load_quantized(path)
    assert model.mode == mode, (model.mode, mode)
    out = model(x)
    error = (out - expected).abs().max().item() / expected.abs().max().item()
    assert error < 1e-4, (path, error)
    graphs = counters["stats"]["unique_graphs"]
    for batch in (1, 3, 16):   # one compile serves every batch size (no recompile per new batch)
        rows = x.repeat(16, *[1] * (x.dim() - 1))[:batch]
        assert model(rows).shape[0] == batch
    assert counters["stats"]["unique_graphs"] == graphs, (path, graphs, counters["stats"]["unique_graphs"])
print("loaded", len(json.loads(sys.argv[1])))
"""


def test_save_then_load_in_a_fresh_process(tmp_path, static_mlp: tuple, weight_only_encoder: tuple,
                                           auto_results: dict) -> None:
    cases = []
    model, example, _, quantized = static_mlp
    _, enc_x, weight_only, _ = weight_only_encoder
    for label, (q, x) in {"static": (quantized, example), "weight_only": (weight_only, enc_x),
                          "auto_cnn": (auto_results["cnn"][3], auto_results["cnn"][1])}.items():
        path, io_path = tmp_path / f"{label}.pt2", tmp_path / f"{label}.io"
        q.save(str(path))
        with torch.no_grad():
            torch.save((x, q(x), q.mode), io_path)
        cases.append((str(path), str(io_path)))
    # The child cannot import this test module: the models' classes are not available there.
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, json.dumps(cases)], capture_output=True,
                          text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"loaded {len(cases)}"
    assert proc.stderr == ""   # loading and compiling print nothing (torchao's CUDA-library notices are muted)


def test_load_rejects_a_plain_exported_program(tmp_path) -> None:
    model, example, _ = make("mlp")
    path = tmp_path / "plain.pt2"
    torch.export.save(torch.export.export(model, (example,)), str(path))
    with pytest.raises(ValueError, match="not written by xlaunch quantize"):
        load_quantized(str(path))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mode": "int4"}, ValueError, "mode must be one of auto, static, dynamic, weight_only"),
    ({"mode": "static"}, ValueError, "mode='static' needs calibration"),
    ({"mode": "static", "calibration": []}, ValueError, "calibration is empty"),
    ({"calibration": torch.zeros(2, 64)}, TypeError, "iterable of input tuples"),
    ({"max_error": 0}, ValueError, "max_error must be > 0"),
])
def test_bad_arguments_give_one_clear_error(kwargs: dict, error: type, match: str) -> None:
    model, example, _ = make("mlp")
    with pytest.raises(error, match=match):
        quantize(model, example, **kwargs)


def test_bad_model_and_inputs() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        quantize(lambda x: x, torch.zeros(1))
    with pytest.raises(TypeError, match="example_inputs must be a tensor"):
        quantize(MLP(), None)


@pytest.mark.parametrize("mode", policy.INT8_ROUTES)
def test_a_model_without_quantizable_layers_is_refused(mode: str) -> None:
    with pytest.raises(ValueError, match="cannot quantize Recurrent: no (nn.)?Linear"):
        quantize(Recurrent().eval(), torch.zeros(2, 3, 8), calibration=[(torch.zeros(2, 3, 8),)], mode=mode)


def test_auto_on_a_model_without_quantizable_layers_warns_and_stays_fp32() -> None:
    model, x = Recurrent().eval(), torch.randn(2, 3, 8)
    with pytest.warns(QuantizeWarning, match="auto returns fp32 for Recurrent: no INT8 route applies") as caught:
        quantized = quantize(model, x, rounds=3)
    assert len(caught) == 1 and quantized.mode == "fp32" and quantized.report.quantized == []
    assert "LSTM has no INT8 route here" in quantized.report.kept_fp32["rnn"]
    with torch.no_grad():
        assert torch.allclose(quantized(x), model(x), atol=1e-5)


def test_public_exports() -> None:
    assert callable(xlaunch.quantize) and xlaunch.kernels.load_quantized is load_quantized
    with pytest.raises(ValueError, match="mode must be one of"):
        xlaunch.quantize(MLP(), torch.zeros(1, 64), mode="fp8")


def test_policy_routes_and_choice() -> None:
    assert policy.isa_traits({"avx2", "fma"}).reduce_range
    assert policy.isa_traits({"avx2", "avx_vnni"}).int8_dot == "avx_vnni"
    assert policy.isa_traits({"amx_int8", "avx512_vnni"}, amx_permitted=False).int8_dot == "avx512_vnni"
    assert policy.candidate_routes(True, False, False)["static"] == "no calibration data given"
    assert policy.candidate_routes(False, True, True)["weight_only"] is not None
    times = {policy.FP32_EAGER: 10.0, policy.FP32_OPTIMIZE: 8.0, "static": 7.9, "dynamic": 5.0}
    assert policy.choose(times, {"static": 0.01, "dynamic": 0.5}, 0.1)[0] == policy.FP32_OPTIMIZE
    assert policy.choose(times, {"static": 0.01, "dynamic": 0.05}, 0.1)[0] == "dynamic"
    assert policy.choose({policy.FP32_EAGER: 1.0, "static": 2.0}, {"static": 0.0}, 0.1)[0] == policy.FP32_EAGER
