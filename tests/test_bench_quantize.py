"""bench/quantize.py with an INT8 route that fails here (an engine installed but not importable): its row says
why and the others are timed (the bench ended in quantize's ValueError). quantize and optimize are faked."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from bench_modules import load

torch = pytest.importorskip("torch")


def test_a_route_that_fails_is_a_row_saying_why(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    bench = load("quantize")

    def quantize(model: Any, x: Any, calibration: Any = None, mode: str = "auto", **_: Any) -> Any:
        if mode in ("openvino_static", "static"):
            raise ValueError(f"quantize: {mode} INT8 failed on Sequential: ImportError: No module named 'openvino'")
        wrapped = torch.nn.Sequential(model)
        wrapped.report = SimpleNamespace(rel_error=0.01, argmax_agreement=0.99)
        return wrapped

    monkeypatch.setattr(bench, "quantize", quantize)
    monkeypatch.setattr(bench, "optimize", lambda model, sample_input=None: model)
    monkeypatch.setattr(bench.engine_routes, "missing", lambda route: None)
    monkeypatch.setattr(bench, "SHAPES", {**bench.SHAPES, "mlp": (2, 784)})
    bench.bench("mlp", 1, False)
    rows = {line.split()[1]: " ".join(line.split()[2:]) for line in capsys.readouterr().out.splitlines()
            if line.startswith("  int8 ")}
    assert rows["openvino_static"] == ("- - failed: openvino_static INT8 failed on Sequential: ImportError: "
                                       "No module named 'openvino'")
    assert rows["static"].startswith("- - failed: static INT8 failed")
    assert rows["dynamic"].endswith("x 0.0100 0.990") and rows["onnxruntime_static"].endswith("x 0.0100 0.990")
