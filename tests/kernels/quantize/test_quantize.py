"""quantize(): every INT8 route on a CNN, an MLP and a transformer encoder, compiled and run for
real; accuracy bounds, auto never slower than fp32 eager, save/load in a fresh process, errors.

Compiles are slow: one ``auto`` build per model (it builds and measures every route) is shared by
the route tests through module-scoped fixtures; the encoder's are in test_quantize_encoder.py, so
that the two test workers compile at the same time.
"""
from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.quantize import routes as quantize_routes  # noqa: E402

from quantize_models import skip_module_without_torchao  # noqa: E402

skip_module_without_torchao()

import xlaunch  # noqa: E402
import xlaunch.kernels  # noqa: E402
from xlaunch.kernels.quantize.api import (  # noqa: E402
    QuantizeWarning, load_quantized, quantize)
from xlaunch.kernels.quantize import policy as policy  # noqa: E402
from quantize_models import (  # noqa: E402
    MAX_ERROR, MLP, auto_quantized, check_auto, check_progress, check_route, make, save_then_load,
    saved_variants, skip_without_inductor)

pytestmark = pytest.mark.torch

# The encoder's routes are in test_quantize_encoder.py: another test worker compiles them meanwhile.
NAMES = ["cnn", "mlp"]


@pytest.fixture(scope="module")
def auto_results() -> dict:
    return auto_quantized(NAMES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("route", policy.TORCH_INT8_ROUTES)
def test_each_route_keeps_accuracy(auto_results: dict, name: str, route: str) -> None:
    check_route(auto_results[name][3].report.routes[route], route)


@pytest.mark.parametrize("name", NAMES)
def test_auto_is_never_slower_than_fp32_eager(auto_results: dict, name: str) -> None:
    check_auto(*auto_results[name])


def test_auto_exports_the_float_model_once_for_both_pt2e_routes(auto_results: dict) -> None:
    """Static and dynamic are prepared from one export (each from its own graph module of it)."""
    skip_without_inductor()
    for name in NAMES:
        assert {"static", "dynamic"} <= set(auto_results[name][5]), name
        assert auto_results[name][6] == 1, (name, auto_results[name][6])


def test_auto_progress_starts_within_a_second(auto_results: dict) -> None:
    for name in NAMES:
        check_progress(auto_results[name][3], auto_results[name][4])


def test_an_explicit_mode_over_max_error_warns(static_mlp: tuple) -> None:
    model, example, calibration, within = static_mlp
    with pytest.warns(QuantizeWarning) as caught:
        quantized = quantize(model, example, calibration=calibration, mode="weight_only", max_error=1e-6)
    error = quantized.report.rel_error
    over = [str(w.message) for w in caught if "max_error" in str(w.message)]
    assert quantized.mode == "weight_only" and error > 1e-6
    assert over == [f"xlaunch.quantize: weight_only INT8 has relative error {error:.4f} against fp32, over "
                    "max_error=1e-06; mode='auto' keeps only routes within it"], over
    assert over[0].removeprefix("xlaunch.quantize: ") in quantized.report.warnings
    # within the limit (static at the default max_error): no such warning
    assert within.report.rel_error <= policy.DEFAULT_MAX_ERROR
    assert not [w for w in within.report.warnings if "max_error" in w], within.report.warnings


def test_auto_report_names_every_variant(auto_results: dict) -> None:
    skip_without_inductor()
    report = auto_results["mlp"][3].report
    assert {policy.FP32_EAGER, policy.FP32_OPTIMIZE, *policy.INT8_ROUTES} <= set(report.routes)
    assert report.reduce_range == (report.isa_int8_dot is None)
    for route in ("static", "dynamic"):   # PT2E: 7-bit activations exactly where sums saturate
        assert report.routes[route].int8_range.startswith("7-bit activations" if report.reduce_range else "8-bit")
    text = str(report)
    assert "fp32_eager" in text and "static" in text
    json.dumps(report.to_dict())


@pytest.fixture(scope="module")
def static_mlp() -> tuple:
    skip_without_inductor()
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


def test_save_then_load_in_a_fresh_process(tmp_path, static_mlp: tuple, auto_results: dict) -> None:
    """Static, auto and the encoder quantized weight-only (attention kept fp32), run compiled as
    loaded, and every route's tiny MLP of test_quantize_saved.py (with each engine route first
    loaded without its engine), all in one fresh process (each process imports torch and torchao:
    seconds)."""
    model, example, _, quantized = static_mlp
    encoder, encoder_x, _ = make("encoder")
    with pytest.warns(QuantizeWarning, match="stay fp32"):
        weight_only = quantize(encoder, encoder_x, mode="weight_only")
    save_then_load(tmp_path, {"static": (quantized, example),
                              "auto_cnn": (auto_results["cnn"][3], auto_results["cnn"][1]),
                              "weight_only_encoder": (weight_only, encoder_x)},
                   {route: value for route, value in saved_variants().items() if not isinstance(value, str)})


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
    ({"max_error": 0}, ValueError, "max_error must be a number > 0"),
    ({"max_error": "0.1"}, ValueError, "max_error must be a number > 0, not '0.1'"),
    ({"rounds": 0}, ValueError, "rounds must be an int >= 1, not 0"),
    ({"rounds": "3"}, ValueError, "rounds must be an int >= 1"),
    ({"calibration": 5}, TypeError, "calibration must be an iterable of input tuples .* not int"),
    ({"calibration": "batches"}, TypeError, "calibration must be an iterable of input tuples .* not str"),
    ({"mode": "dynamic", "consider": ["static"]}, ValueError, "consider= limits what mode='auto' builds; mode='dynamic'"),
    ({"progress": "no"}, TypeError, "quantize: progress must be True or False, not 'no'"),
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
    with pytest.warns(QuantizeWarning, match="auto returns fp32 for Recurrent: no INT8 route was built") as caught:
        quantized = quantize(model, x, rounds=3)
    assert len(caught) == 1 and quantized.mode == "fp32" and quantized.report.quantized == []
    assert "LSTM has no INT8 route here" in quantized.report.kept_fp32["rnn"]
    assert policy.FP32_OPTIMIZE not in quantized.report.routes   # nothing to compare: no engine built
    with torch.no_grad():
        assert torch.allclose(quantized(x), model(x), atol=1e-5)


def test_auto_says_a_route_failed_apart_from_routes_that_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """A route that raises is a failure with its error, not "does not apply"; with nothing built
    nothing is timed, and the progress does not say an accuracy gate chose fp32."""
    from xlaunch.kernels.quantize import api

    def broken(model):
        raise RuntimeError("torchao broke")

    monkeypatch.setattr(quantize_routes, "build_weight_only", broken)
    lines: list[str] = []
    monkeypatch.setattr(api.Progress, "line", lambda self, text: lines.append(text))
    with pytest.warns(QuantizeWarning) as caught:
        quantized = quantize(MLP().eval(), torch.randn(2, 64), consider=["weight_only", "static"])
    reason = quantized.report.reason
    assert quantized.mode == "fp32" and reason == (
        "no INT8 route was built: 1 failed (weight_only: RuntimeError: torchao broke); 1 does not apply "
        "(static: no calibration data given); 3 left out by consider= (dynamic, openvino_static, onnxruntime_static)")
    assert [str(w.message) for w in caught] == [f"xlaunch.quantize: auto returns fp32 for MLP: {reason}"]
    assert f"kept fp32: {reason}" in lines and not any("relative error within max_error" in line for line in lines)
    assert policy.FP32_EAGER not in quantized.report.routes   # nothing was timed
    assert policy.nothing_built({"static": "no Linear or Conv2d layer"}) == (
        "no INT8 route was built: 1 does not apply (static: no Linear or Conv2d layer)")


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


def test_convolutions_an_unbacked_batch_breaks_compile_with_a_dynamic_batch_at_once() -> None:
    """An unbacked batch fails in inductor's lowering of a dynamically quantized (or fp32)
    convolution after a whole compile: such a program goes to a dynamic batch directly, a
    statically quantized one stays unbacked (one compile serves batch 1 too; its Flatten keeps the
    batch apart), as does a program without convolutions. (The auto fixtures compile and run both
    CNN routes; test_quantize_encoder.py has a view that folds the batch.)"""
    from xlaunch.kernels.quantize import routes

    model, example, calibration = make("cnn")
    for dynamic in (True, False):
        built = routes.build_pt2e(model, (example,), calibration, dynamic, True)
        assert routes.unbacked_batch_fails(built.program_source) is dynamic
        assert built.runner.how == ("dynamic" if dynamic else "unbacked") and built.runner.calls == 0
    mlp, mlp_example, mlp_calibration = make("mlp")
    built = routes.build_pt2e(mlp, (mlp_example,), mlp_calibration, True, True)
    assert not routes.unbacked_batch_fails(built.program_source) and built.runner.how == "unbacked"


class Narrow(nn.Module):
    """A view only: inductor compiles it without a C++ kernel (no compiler run)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 2:5]


def test_unbacked_compiles_neither_read_nor_write_the_on_disk_graph_caches(monkeypatch) -> None:
    """A failed unbacked compile could leave a graph without its ``batch == 1`` assert in inductor's
    or AOTAutograd's cache, and the next process would compile "unbacked" from it and return wrong
    values for every batch but 1 (reproduced with torch 2.13, docs/quantization.md): both caches
    are off while an unbacked batch compiles, untouched for a dynamic one. (The reproduction takes
    ~20 s of compiles, so the test reads the configuration each compile ran under.)"""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from xlaunch.kernels.optimize.engines.routes import inductor_route

    seen = []

    def records(self, args: tuple, how: str):
        seen.append((how, inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache))
        if how == "unbacked":
            raise AssertionError("Guard failed on the same frame it was created")
        self.compiled = self.module
        return self.module(*args)

    monkeypatch.setattr(inductor_route.FrozenDynamicBatch, "_compile_call", records)
    before = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    quantize_routes.FrozenCompiled(Narrow().eval())(torch.randn(4, 8))     # unbacked fails: the retry in that call
    inductor_route.FrozenDynamicBatch(Narrow().eval(), how="dynamic")(torch.randn(4, 8))
    assert seen == [("unbacked", False, False), ("dynamic", False, False), ("dynamic", *before)]
    assert (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache) == before


def test_an_unbacked_compile_that_fails_compiles_again_with_a_dynamic_batch(monkeypatch) -> None:
    """What unbacked_batch_fails does not foresee still runs: the failed unbacked compile is
    forgotten and the module compiles with a dynamic batch (the test CNN and encoder no longer
    reach this path, being foreseen; the failure is raised here, where inductor's takes a whole
    compile)."""
    skip_without_inductor()
    from xlaunch.kernels.optimize.engines.routes import inductor_route

    tried, compile_call = [], inductor_route.FrozenDynamicBatch._compile_call

    def fails_unbacked(self, args: tuple, how: str):
        tried.append(how)
        if how == "unbacked":
            raise AssertionError("Guard failed on the same frame it was created")
        return compile_call(self, args, how)

    monkeypatch.setattr(inductor_route.FrozenDynamicBatch, "_compile_call", fails_unbacked)
    model = Narrow().eval()
    runner = quantize_routes.FrozenCompiled(model)
    assert runner.how == "unbacked"
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(runner(x), model(x))
        assert tried == ["unbacked", "dynamic"] and runner.how == "dynamic" and runner.calls == 1
        torch.testing.assert_close(runner(x[:3]), model(x[:3]))   # the dynamic graph serves batch 3
    assert tried == ["unbacked", "dynamic"] and runner.calls == 2


def test_a_layer_the_route_converted_is_not_also_reported_fp32() -> None:
    """A Conv1d is among the kinds no route is known to convert, yet the dynamic PT2E route does
    convert it: the report listed it both as quantized and as kept fp32, with a false warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = quantize(model, (torch.randn(2, 3, 16),), mode="dynamic", progress=False)
    report = quantized.report
    assert "3" in report.quantized
    assert not set(report.quantized) & set(report.kept_fp32), (report.quantized, report.kept_fp32)
    stay = [str(w.message) for w in caught if issubclass(w.category, QuantizeWarning) and "stay fp32" in str(w.message)]
    if "0" in report.quantized:
        assert not any("Conv1d" in message for message in stay), stay
    else:
        assert "0" in report.kept_fp32 and len(stay) == 1


class _SharedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.relu(self.a(x)))


def test_a_layer_called_twice_is_reported_once() -> None:
    """The PT2E graph holds one linear per call: a shared Linear was listed twice (``quantized (2): a, a``)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = _SharedLinear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(model, (x,), mode="dynamic", progress=False)
    assert quantized.report.quantized == ["a"]
    assert (quantized(x) - model(x)).abs().max().item() <= 0.1 * model(x).abs().max().item()


def test_a_route_that_inductor_fails_names_the_real_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile wraps the error (``backend='inductor' raised:`` on the first line, and nothing
    else in the one line quoted before): the error it carries is named, in the ValueError and in auto's report."""
    from torch._dynamo.exc import BackendCompilerFailed

    from xlaunch.kernels.quantize import api
    from quantize_models import tiny_mlp

    def fails(*_args: object) -> None:
        raise BackendCompilerFailed(lambda: None, TypeError("torch.Size() takes an iterable of 'int'"), None)

    monkeypatch.setattr(api, "_build", fails)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"dynamic INT8 failed on Sequential: TypeError: torch.Size\(\) takes"):
        quantize(tiny_mlp(), x, mode="dynamic", progress=False)
    with pytest.warns(QuantizeWarning):
        quantized = quantize(tiny_mlp(), x, consider=["dynamic"], rounds=1, progress=False)
    assert quantized.report.routes["dynamic"].skipped == "failed: TypeError: torch.Size() takes an iterable of 'int'"
