"""bench/engines.py's tables when a peer cannot run here: a route that fell back is not timed under its name
(its row timed the route it fell back to, and could be named the best), and OpenVINO's own row without
OpenVINO is skipped with its reason instead of ending the bench. The engines are faked: no build, no compile."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from bench_modules import load

torch = pytest.importorskip("torch")

NO_OPENVINO = "failed: ImportError: No module named 'openvino'"


@dataclass
class Route:
    skipped: Optional[str] = None


@dataclass
class Report:
    backend: str
    reason: str = ""
    routes: dict[str, Route] = field(default_factory=dict)


def fake_optimize(model: Any, sample_input: Any = None, backend: str = "torch", **_: Any) -> Any:
    """optimize as on a machine without OpenVINO: backend="openvino" runs the torch route, auto keeps inductor."""
    ran = {"openvino": "torch", "auto": "inductor"}.get(backend, backend)
    module = torch.nn.Sequential(model)
    module._xlaunch_engine_report = Report(ran, "", {"openvino": Route(NO_OPENVINO)})
    return module


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Any:
    engines = load("engines")
    monkeypatch.setattr(engines, "optimize", fake_optimize)
    monkeypatch.setattr(engines, "workload", lambda name: (torch.nn.Linear(4, 4).eval(), torch.randn(2, 4)))
    return engines


def test_a_route_that_fell_back_is_not_timed_under_its_name(engines: Any, capsys: pytest.CaptureFixture) -> None:
    got = engines.bench_model("mlp", 1)
    assert "openvino" not in got["ms"] and set(got["ms"]) == {"eager", "optimize (torch)", "onnxruntime", "inductor",
                                                               "auto"}
    assert got["not_timed"] == {"openvino": f"openvino fell back to torch ({NO_OPENVINO})"}
    assert got["best"] != "openvino"
    rows = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines() if line.startswith("  openvino ")]
    assert rows == [f"openvino - not timed: openvino fell back to torch ({NO_OPENVINO})"]


def test_bf16_without_openvino_skips_its_rows_and_runs_the_rest(engines: Any, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    def no_openvino(model: Any, x: Any) -> Any:
        raise ImportError("No module named 'openvino'")

    monkeypatch.setattr(engines, "openvino_default", no_openvino)
    got = engines.bench_bf16("mlp", 1)
    assert set(got["ms"]) == {"eager fp32", "eager autocast", "optimize (torch)", "inductor", "auto"}
    assert got["not_timed"] == {"openvino bf16": f"openvino fell back to torch ({NO_OPENVINO})",
                                "openvino default": "ImportError: No module named 'openvino'"}
    assert got["best"] in {"eager autocast", "optimize (torch)", "inductor"}
    out = capsys.readouterr().out
    assert "  openvino default   not built: ImportError: No module named 'openvino'" in out
    assert "  openvino default            - not timed: ImportError: No module named 'openvino'" in out
