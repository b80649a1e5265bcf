"""optimize(dtype=torch.bfloat16, backend=...): every route in bf16, the per-precision accuracy
gate against fp32 eager, outputs in eager's dtypes, OpenVINO's precision pinned per route.

The gate runs in-process with fake routes; one small real build (OpenVINO in bf16 and f32, one
thread) checks the engine route itself. ``force_bf16=True`` keeps the tests meaningful on CPUs
without native bf16 (the engines then run bf16 emulated or fall back: only correctness is checked).
"""
from __future__ import annotations

import importlib.util
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optimize.engines import api, auto, lowp, policy  # noqa: E402
from xlaunch.kernels.optimize.engines.base import Built, Route  # noqa: E402
from xlaunch.kernels.optimize.engines.routes.openvino_route import compile_config  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Off(Route):
    """The model's answer off by ``scale`` relative error (a bf16-like rounding, or a wrong route)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def build(self, model, sample, context):
        def run(x):
            with torch.no_grad():
                out = model(x)
            return out + self.scale * out.abs().max()
        return Built(run)


def test_the_bf16_gate_keeps_bf16_rounding_and_rejects_a_wrong_route(monkeypatch: pytest.MonkeyPatch) -> None:
    fp32_gate, bf16_gate = policy.max_rel_error("float32"), policy.max_rel_error("bfloat16")
    assert fp32_gate < 5e-3 < bf16_gate < 1e-1
    table = dict(api.ROUTES_BY_NAME)
    for name, route in (("openvino", Off(5e-3)), ("inductor", Off(1e-1))):
        route.name = name
        table[name] = route
    monkeypatch.setattr(api, "ROUTES_BY_NAME", table)
    torch.manual_seed(0)
    model, x = Small().eval(), torch.randn(4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = optimize(model, dtype=torch.bfloat16, sample_input=x, backend="auto", cache=False,
                        progress=False, time_budget=5, force_bf16=True)
    report = fast.report
    assert report.dtype == "bfloat16" and report.max_rel_error == bf16_gate, str(report)
    routes = report.routes
    assert routes["openvino"].skipped is None and 4e-3 < routes["openvino"].rel_error <= bf16_gate
    assert routes["inductor"].skipped.startswith("wrong results: max relative error")
    assert routes["inductor"].rel_error > bf16_gate and routes["inductor"].ms is None
    assert "no bfloat16 MatMul/Conv kernels" in routes["onnxruntime"].skipped   # real route: unfit for bf16
    assert routes["torch"].skipped is None   # the torch route in bf16, checked with the same gate
    assert "precision: bfloat16 (gate: max relative error 0.03" in str(report)
    assert report.backend in ("eager", "torch", "openvino")
    with torch.no_grad():
        assert fast(x).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):   # the dtype eager gives in the caller's context
            assert fast(x).dtype == model(x).dtype == torch.bfloat16


def test_follow_eager_dtypes_learns_the_autocast_dtype_once() -> None:
    calls = []

    def eager(x):
        calls.append(1)
        return {"a": x.to(torch.bfloat16), "i": x.long()}

    follow = lowp.FollowEagerDtypes(lambda x: {"a": x.clone(), "i": x.long()}, eager, [torch.float32, None])
    x = torch.ones(2)
    assert follow(x)["a"].dtype == torch.float32 and calls == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            out = follow(x)
            assert out["a"].dtype == torch.bfloat16 and out["i"].dtype == torch.long
    assert calls == [1]


@pytest.mark.parametrize("flags, bf16_hint", [(("avx2", "fma", "avx512f", "avx512_bf16"), "bf16"),
                                               (("avx2", "fma", "avx512f", "amx_bf16"), "bf16"),
                                               (("avx2", "fma"), "f32"), (("avx2", "fma", "avx512f"), "f32")])
def test_openvino_pins_f32_for_fp32_and_bf16_for_bf16_where_native(
        monkeypatch: pytest.MonkeyPatch, flags: tuple, bf16_hint: str) -> None:
    """The CPU's flags are faked. Without native bf16 (a real AVX2 CPU, or ``ONEDNN_MAX_CPU_ISA``
    below bf16) the hint is f32: under that ceiling OpenVINO's bf16 returned empty outputs."""
    from xlaunch.kernels import native_dtypes

    monkeypatch.setattr(native_dtypes, "isa_flags", lambda: frozenset(flags))
    assert compile_config(2)["INFERENCE_PRECISION_HINT"] == "f32"   # its default here may be bf16
    assert compile_config(2, torch.float32)["INFERENCE_PRECISION_HINT"] == "f32"
    assert compile_config(2, torch.bfloat16)["INFERENCE_PRECISION_HINT"] == bf16_hint
    assert compile_config(2, torch.float16)["INFERENCE_PRECISION_HINT"] == "f32"   # no avx512_fp16
    assert compile_config(0)["INFERENCE_NUM_THREADS"] == 1


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="openvino is not installed")
def test_bf16_auto_builds_the_openvino_route_in_bf16_and_fp32_pins_f32() -> None:
    torch.manual_seed(0)
    model, x = Small().eval(), torch.randn(4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = optimize(model, dtype=torch.bfloat16, sample_input=x, backend=["openvino"], cache=False,
                        progress=False, time_budget=5, force_bf16=True)
    route = fast.report.routes["openvino"]
    assert route.skipped is None and route.ms is not None, str(fast.report)
    assert route.rel_error <= policy.max_rel_error("bfloat16")
    assert fast.report.backend in ("eager", "torch", "openvino")
    with torch.no_grad():
        assert fast(x).dtype == torch.float32
        assert torch.allclose(fast(x), model(x), atol=0.05 * model(x).abs().max().item())
    from xlaunch.kernels.optimize.engines.routes.openvino_route import CompiledRunner, convert
    from xlaunch.kernels.optimize.engines.sample import Sample

    sample = Sample(model, x)
    ov_model = convert(model, sample)
    for dtype, expected in ((None, ("f32", "float32")), (torch.bfloat16, ("bf16", "bfloat16"))):
        hint = str(CompiledRunner(ov_model, sample, 1, dtype).compiled.get_property("INFERENCE_PRECISION_HINT"))
        assert any(name in hint for name in expected) or dtype is not None, hint   # bf16: where native


@pytest.mark.parametrize("flags", [("avx2", "fma"), ("avx2", "fma", "avx512f", "avx512_bf16")])
def test_bf16_without_native_bf16_is_fp32_auto_with_every_engine_and_one_warning(
        monkeypatch: pytest.MonkeyPatch, flags: tuple) -> None:
    """The CPU's flags are faked (any machine, AMX included, runs both cases): without native bf16,
    ``auto`` with bf16 measures every route in fp32 (ONNX Runtime too, which has no bf16 kernels)
    after one warning; with native bf16 the routes run bf16 and ONNX Runtime is skipped."""
    from xlaunch.kernels.optimize import precision
    from xlaunch.kernels.optimize.notes import OptimizeWarning

    monkeypatch.setattr(precision, "isa_flags", lambda: frozenset(flags))
    table = dict(api.ROUTES_BY_NAME)
    for name in ("onnxruntime", "openvino", "inductor"):
        route = Off(0.0)
        route.name = name
        table[name] = route
    monkeypatch.setattr(api, "ROUTES_BY_NAME", table)

    def rounds(built, sample, report, budget_s, progress):   # which routes are built is the point, not the clock
        for name in built:
            report.routes[name].ms = 1.0
        return {name: [1.0] * 5 for name in built}

    monkeypatch.setattr(auto, "time_routes", rounds)
    torch.manual_seed(0)
    model, x = Small().eval(), torch.randn(4, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = optimize(model, dtype=torch.bfloat16, sample_input=x, backend="auto", cache=False,
                        progress=False, time_budget=600)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    routes = fast.report.routes
    if "avx512_bf16" in flags:
        assert fast.report.dtype == "bfloat16" and "no bfloat16 MatMul/Conv" in routes["onnxruntime"].skipped
        assert not any("emulated" in text for text in said), said
        return
    assert len(said) == 1 and issubclass(caught[0].category, OptimizeWarning), said
    assert "bf16 not used" in said[0] and "emulated" in said[0] and "every route runs in float32" in said[0]
    assert "\n" not in said[0]
    assert fast.report.dtype == "float32" and fast.report.max_rel_error == policy.max_rel_error("float32")
    assert set(routes) == {"eager", "torch", "onnxruntime", "openvino", "inductor"}
    assert all(result.skipped is None and result.ms is not None for result in routes.values()), str(fast.report)
    with torch.no_grad():
        assert fast(x).dtype == torch.float32 and torch.allclose(fast(x), model(x), atol=1e-5)
