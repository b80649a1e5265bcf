"""quantize() on a transformer encoder: every INT8 route, auto, weight-only (attention stays
fp32; saved and loaded in test_quantize.py's fresh process). Apart from test_quantize.py so that
another test worker compiles these graphs while that file compiles the CNN's and the MLP's."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from xlaunch.kernels.quantize import routes as quantize_routes  # noqa: E402

from quantize_models import skip_module_without_torchao  # noqa: E402

skip_module_without_torchao()

from quantize_models import (  # noqa: E402
    MAX_ERROR, auto_quantized, check_auto, check_progress, check_route, make, skip_without_inductor)

from xlaunch.kernels.quantize import policy  # noqa: E402
from xlaunch.kernels.quantize.api import QuantizeWarning, quantize  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def auto_encoder() -> tuple:
    return auto_quantized(["encoder"])["encoder"]


@pytest.mark.parametrize("route", policy.TORCH_INT8_ROUTES)
def test_each_route_keeps_accuracy_on_the_encoder(auto_encoder: tuple, route: str) -> None:
    check_route(auto_encoder[3].report.routes[route], route)


def test_auto_on_the_encoder_is_never_slower_than_fp32_eager(auto_encoder: tuple) -> None:
    check_auto(*auto_encoder)


def test_auto_progress_on_the_encoder_starts_within_a_second(auto_encoder: tuple) -> None:
    check_progress(auto_encoder[3], auto_encoder[4])


def test_the_encoder_compiles_with_a_dynamic_batch_the_first_time(auto_encoder: tuple) -> None:
    """Attention folds the batch with the heads (a view to ``(S, B*H, E/H)``): with an unbacked
    batch inductor's lowering of that view fails the compile after seconds of work. The graph
    says so before the first call, so each PT2E route compiles once, with a dynamic batch (the
    runner's ``how`` changes only when an unbacked compile fails)."""
    skip_without_inductor()
    builds = auto_encoder[5]
    for route in ("static", "dynamic"):
        assert quantize_routes.unbacked_batch_fails(builds[route].program_source), route
        runner = builds[route].runner
        assert runner.how == "dynamic" and runner.calls >= 1, (route, runner.how, runner.calls)


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
