"""optimize()'s default (torch) route says what it is doing once a call lasts: its first line comes
within a second, under its own name (``xlaunch.optimize: ...``); a short call stays silent."""
from __future__ import annotations

import time
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optimize import pipeline  # noqa: E402
from xlaunch.kernels.optimize.progress import Progress  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


class Stamped:
    """A stderr that records when each line was written."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.extend((time.perf_counter(), line) for line in text.splitlines() if line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class Slow(nn.Module):
    """Every call takes 40 ms: timing three variants takes seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.04)
        return self.net(x)


def run(monkeypatch: pytest.MonkeyPatch, model: nn.Module, **kwargs) -> tuple[float, float, list[tuple[float, str]]]:
    stderr = Stamped()
    monkeypatch.setattr("sys.stderr", stderr)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline.optimize(model.eval(), sample_input=torch.randn(2, 16), **kwargs)
    return start, time.perf_counter(), stderr.lines


def test_a_call_of_seconds_says_each_step_from_its_first_second(monkeypatch: pytest.MonkeyPatch) -> None:
    start, end, lines = run(monkeypatch, Slow())
    assert end - start > 1.0 and lines, f"{end - start:.1f} s, {lines}"
    assert lines[0][0] - start < 1.0, f"first line after {lines[0][0] - start:.2f} s: {lines[0][1]}"
    assert all(text.startswith("xlaunch.optimize: ") for _, text in lines), lines
    texts = [text for _, text in lines]
    timing = "xlaunch.optimize: timing the model as given, the eager rewrite and the frozen graph"
    assert f"{timing} ..." in texts and any(t.startswith(f"{timing}: ") and t.endswith(" s)") for t in texts), texts
    starts = [text for text in texts if text.endswith(" ...")]
    assert len(texts) == 2 * len(starts), texts   # every step announced also says how it ended


def test_a_short_call_or_progress_false_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    quick = nn.Sequential(nn.Linear(16, 4))
    _, _, lines = run(monkeypatch, quick, measure=False, weights_prepack=False)
    assert lines == []
    _, _, lines = run(monkeypatch, Slow(), progress=False)
    assert lines == []


def test_quiet_progress_announces_the_step_running_at_its_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = Stamped()
    monkeypatch.setattr("sys.stderr", stderr)
    show = Progress(total=0, quiet_s=0.2)
    with show.step("short") as step:
        step.done("ok")
    with show.step("long") as step:
        time.sleep(0.4)
        step.done("ok")
    with show.step("after") as step:   # once loud, every step is said
        step.done("ok")
    show.close()
    texts = [text for _, text in stderr.lines]
    assert texts[0] == "xlaunch.optimize: long ..." and texts[1].startswith("xlaunch.optimize: long: ok (")
    assert texts[2:4] == ["xlaunch.optimize: after ...", texts[3]] and texts[3].startswith("xlaunch.optimize: after: ok")
    assert len(texts) == 4
