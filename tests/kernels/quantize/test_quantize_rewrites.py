"""A recurrent layer followed by a Linear (a tagger, a speech model's head): the PT2E routes keep
the LSTM/GRU fp32, quantize the Linear, say so, and the result saves and loads.

Before the fix the route failed to build: a ``batch_first`` GRU/LSTM returns a non-contiguous
sequence, a Linear on it decomposes to expand + bmm, and torchao's x86 inductor pass raised
``TypeError: torch.Size() takes an iterable of 'int' (item 0 is 'Node')`` on the symbolic batch
(``routes.contiguous_linear_inputs``)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.quantize import routes  # noqa: E402

try:
    routes.import_torchao()
except ImportError:
    pytest.skip("torchao is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from xlaunch.kernels.quantize.api import QuantizeWarning, quantize  # noqa: E402
from quantize_models import MAX_ERROR, save_then_load, skip_without_inductor, tiny_mlp  # noqa: E402

pytestmark = pytest.mark.torch


class Tagger(nn.Module):
    """A GRU over the sequence, a Linear on every step: the Linear's input is non-contiguous."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _copies(model: nn.Module, example: torch.Tensor) -> tuple[int, nn.Module]:
    graph = routes.export(model, (example,)).module()
    return routes.contiguous_linear_inputs(graph), graph


def test_a_linear_on_a_non_contiguous_sequence_reads_a_contiguous_copy() -> None:
    model, x = Tagger().eval(), torch.randn(3, 4, 8)
    copies, graph = _copies(model, x)
    assert copies == 1
    clones = [n for n in graph.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert [user.target for user in clones[0].users] == [torch.ops.aten.linear.default]
    with torch.no_grad():
        assert torch.equal(graph(x), model(x))
    assert _copies(tiny_mlp().eval(), torch.randn(3, 16))[0] == 0   # contiguous inputs: nothing added


def test_dynamic_quantizes_the_linear_after_a_gru_and_saves(tmp_path) -> None:
    skip_without_inductor()
    model, x = Tagger().eval(), torch.randn(4, 6, 8)
    with pytest.warns(QuantizeWarning, match="rnn: GRU has no INT8 route here"):
        quantized = quantize(model, x, mode="dynamic", progress=False)
    report = quantized.report
    assert (quantized.mode, report.quantized, list(report.kept_fp32)) == ("dynamic", ["head"], ["rnn"])
    with torch.no_grad():
        for rows in (x, x[:3]):
            ref, out = model(rows), quantized(rows)
            assert out.shape == ref.shape and (ref - out).abs().max() <= MAX_ERROR["dynamic"] * ref.abs().max()
    save_then_load(tmp_path, {"dynamic_gru": (quantized, x)}, {})
