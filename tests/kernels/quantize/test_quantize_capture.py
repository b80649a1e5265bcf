"""A model torch.export cannot capture (a branch on a tensor's value): ``quantize`` and ``save`` say
so in one line naming the model's line, and print nothing (torch.export printed its partial graph
on stderr at every try, dozens of lines, and ``save`` raised GuardOnDataDependentSymNode from deep
inside). The holding is per thread: another thread's stderr passes through (``capture.held_back``).
weight_only: no compile, cheap."""
from __future__ import annotations

import sys
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.quantize import capture  # noqa: E402

from quantize_models import skip_module_without_torchao  # noqa: E402

skip_module_without_torchao()

from xlaunch.kernels.quantize.api import quantize  # noqa: E402

pytestmark = pytest.mark.torch


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


def test_a_model_export_cannot_capture_is_one_line_and_nothing_printed(tmp_path, capfd) -> None:
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(Branchy().eval(), x, mode="weight_only", progress=False)
    with torch.no_grad():
        assert quantized(x).shape == (4, 8)   # it runs here
    capfd.readouterr()
    path = tmp_path / "branchy.pt2"
    with pytest.raises(ValueError) as caught:
        quantized.save(str(path))
    message = str(caught.value)
    assert message.startswith(f"save: {path}: the weight_only model cannot be saved: torch.export cannot capture "
                              "Branchy: "), message
    assert "test_quantize_capture.py:" in message and ": if x.sum() > 0:)" in message and "\n" not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert capfd.readouterr().err == ""
    assert list(tmp_path.iterdir()) == []   # nothing written, no partial file left


def test_only_the_exporting_thread_is_held_and_a_success_gives_it_out(capfd) -> None:
    def other() -> None:
        print("from another thread", file=sys.stderr)

    with capture.held_back() as held:
        print("from the exporting thread", file=sys.stderr)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert held == [("stderr", "from the exporting thread"), ("stderr", "\n")]
    assert capfd.readouterr().err == "from another thread\n"
    capture.give_out(held)
    assert capfd.readouterr().err == "from the exporting thread\n"
    assert not isinstance(sys.stderr, capture._Stream) and not isinstance(sys.stdout, capture._Stream)   # put back
