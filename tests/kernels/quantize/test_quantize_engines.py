"""quantize(mode="auto") across engines: OpenVINO INT8 (NNCF) and ONNX Runtime static QDQ built
from the same calibration batches as PT2E static, gated on accuracy, timed with the float variants;
the choice among fp32, bf16 and INT8 (pure policy). One small build on the MLP (the fp32/bf16
optimize() variants are left out here: test_quantize.py measures those)."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from quantize_models import MAX_ERROR, make  # noqa: E402

from xlaunch.kernels.quantize import api, engine_routes, policy  # noqa: E402
from xlaunch.kernels.quantize.api import load_quantized, quantize  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


def test_auto_builds_the_other_engines_int8_routes(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(api, "_optimized", lambda *args, **kwargs: None)   # fp32 eager is the float variant
    model, example, calibration = make("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(model, (example,), calibration=calibration, consider=policy.ENGINE_INT8_ROUTES, rounds=3)
    report = quantized.report
    for route in policy.ENGINE_INT8_ROUTES:
        result = report.routes[route]
        missing = engine_routes.missing(route)
        if missing is not None:   # that engine's extra is not installed: skipped, saying which
            assert result.skipped == missing and "pip install" in missing
            continue
        assert result.skipped is None, result.skipped
        assert result.rel_error <= MAX_ERROR[route] and result.argmax_agreement >= 0.9, result
        assert result.ms > 0
        # 7-bit weights exactly where this CPU's u8 x s8 sums saturate (no VNNI/AMX), and the report says so
        assert result.int8_range.startswith("7-bit weights" if report.reduce_range else "8-bit weights"), result
        assert result.int8_range in str(report)
    for route in policy.TORCH_INT8_ROUTES:
        assert report.routes[route].skipped == "not among consider="
    assert quantized.mode in (*policy.ENGINE_INT8_ROUTES, "fp32"), str(report)
    with torch.no_grad():
        ref, out = model(example), quantized(example)
        assert (ref - out).abs().max() <= policy.DEFAULT_MAX_ERROR * ref.abs().max()
        assert quantized(example[:3]).shape == (3, 10)   # one build serves another batch size
    if quantized.mode in policy.ENGINE_INT8_ROUTES:   # what auto keeps saves and loads (test_quantize_saved.py)
        quantized.save(str(tmp_path / "auto.xq"))
        with torch.no_grad():
            torch.testing.assert_close(load_quantized(str(tmp_path / "auto.xq"))(example), quantized(example),
                                       rtol=1e-5, atol=0)


def _int8_weight_extreme(ov_model) -> int:
    """The largest |value| among the quantized model's int8 weight constants."""
    import openvino as ov

    return max(int(abs(op.get_data().astype("int32")).max()) for op in ov_model.get_ordered_ops()
               if op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.i8)


def test_openvino_route_follows_a_forced_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ISA this CPU does not have, forced: NNCF's overflow fix (weights on [-64, 64]) exactly
    when there is no VNNI/AMX, full 8-bit weights (±127) otherwise, and the report says which."""
    if engine_routes.missing(engine_routes.OPENVINO) is not None:
        pytest.skip(engine_routes.missing(engine_routes.OPENVINO))
    host = api._machine_traits()
    forced = policy.IsaTraits(int8_dot="avx512_vnni" if host.int8_dot is None else None, avx2=True)
    monkeypatch.setattr(api, "_machine_traits", lambda: forced)
    built, real = [], engine_routes.build_openvino
    monkeypatch.setattr(engine_routes, "build_openvino", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    model, example, calibration = make("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(model, (example,), calibration=calibration, mode=engine_routes.OPENVINO)
    report = quantized.report
    assert report.isa_int8_dot == forced.int8_dot and report.reduce_range == forced.reduce_range
    extreme = _int8_weight_extreme(built[0].engine_model)
    if forced.reduce_range:
        assert extreme <= 64 and report.routes[quantized.mode].int8_range.startswith("7-bit weights"), extreme
        assert "7-bit operands" in str(report)
    else:
        assert extreme == 127 and report.routes[quantized.mode].int8_range.startswith("8-bit weights"), extreme
    assert f"int8 range: {report.routes[quantized.mode].int8_range}" in str(report)


def test_the_choice_counts_bf16_among_the_float_variants() -> None:
    times = {policy.FP32_EAGER: 10.0, policy.FP32_OPTIMIZE: 6.0, policy.BF16_OPTIMIZE: 4.0,
             "static": 5.0, "openvino_static": 3.0, "onnxruntime_static": 3.9}
    errors = {"static": 0.01, "openvino_static": 0.5, "onnxruntime_static": 0.02}
    assert policy.choose(times, errors, 0.1)[0] == policy.BF16_OPTIMIZE   # INT8 must beat bf16 too
    errors["openvino_static"] = 0.02
    choice, why = policy.choose(times, errors, 0.1)
    assert choice == "openvino_static" and "bf16_optimize" in why
    assert policy.candidate_routes(True, False, False)["openvino_static"] == "no calibration data given"
    assert policy.check_routes(None) == policy.AUTO_ROUTES
    with pytest.raises(ValueError, match="consider must be among"):
        policy.check_routes(["tensorrt"])


def test_the_reported_error_covers_the_example_not_only_the_calibration() -> None:
    """Static INT8 calibrated on one sample: its activation ranges fit that sample alone. The error
    was measured on that same sample only (0.009 reported, 0.11 on the example); the example
    inputs count now, and the report's error is at least the example's."""
    if engine_routes.missing(engine_routes.ONNXRUNTIME) is not None:
        pytest.skip(engine_routes.missing(engine_routes.ONNXRUNTIME))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    example, sample = torch.randn(1, 16), torch.randn(1, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(model, example, calibration=[(sample,)], mode=engine_routes.ONNXRUNTIME, progress=False)
    with torch.no_grad():
        ref = model(example)
        on_example = ((quantized(example) - ref).abs().max() / ref.abs().max()).item()
    assert on_example > 0.05   # what the test is about: the example is far from the one calibration sample
    assert quantized.report.rel_error >= on_example - 1e-6, (quantized.report.rel_error, on_example)
    # the example among the batches: measured once, as one of them
    assert api._same((example,), (example.clone(),)) and not api._same((example,), (sample,))


def test_a_model_returning_class_indices_reports_how_many_differ() -> None:
    """Integer outputs were skipped by the error: a model returning ``argmax`` reported 0.0 with 27%
    of its predictions wrong (ONNX Runtime static INT8 calibrated on one sample), and ``auto``
    would keep it. They count by the fraction of elements that differ now."""
    from xlaunch.kernels.quantize.measure import accuracy

    assert accuracy([torch.tensor([1, 2, 3])], [torch.tensor([1, 0, 3])]) == pytest.approx((1 / 3, 2 / 3))
    assert accuracy([torch.tensor([True, False])], [torch.tensor([True, False])]) == (0.0, 1.0)
    if engine_routes.missing(engine_routes.ONNXRUNTIME) is not None:
        pytest.skip(engine_routes.missing(engine_routes.ONNXRUNTIME))

    class Predicts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x))).argmax(-1)

    model, x, sample = Predicts().eval(), torch.randn(64, 16) * 3, torch.randn(1, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(model, x, calibration=[(sample,)], mode=engine_routes.ONNXRUNTIME, progress=False)
    with torch.no_grad():   # the inputs the error is measured on: the calibration sample and the example
        pairs = [(quantized(t), model(t)) for t in (sample, x)]
    assert quantized.report.rel_error == pytest.approx(max((q != r).float().mean().item() for q, r in pairs))
    assert quantized.report.argmax_agreement == pytest.approx(sum((q == r).sum().item() for q, r in pairs) / 65)
