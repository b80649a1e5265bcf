"""The PT2E routes' graph rewrites before quantization, for torchao's x86 inductor passes, which
failed whole routes on the symbolic batch every compile here has:

* a recurrent layer followed by a Linear (a tagger, a speech model's head): the LSTM/GRU stays fp32,
  the Linear is quantized, the report says so. A ``batch_first`` GRU/LSTM returns a non-contiguous
  sequence, a Linear on it decomposes to expand + bmm, and the pass raised ``TypeError:
  torch.Size() takes an iterable of 'int' (item 0 is 'Node')`` (``rewrites.contiguous_linear_inputs``);
* a bias-like buffer added to a Linear's output (``linear(x) + self.offset``): the qlinear + add
  fusion compared ``(B, 8)`` with ``(8,)``, i.e. the batch with 8, and a compiling call at batch 8
  failed (``ConstraintViolationError``), in ``quantize`` and at a loaded model's first call
  (``rewrites.full_rank_linear_adds``); an unbacked compile of that graph fails at every batch, so it
  compiles dynamic at once (``routes.unbacked_batch_fails``).

Both models save and load in one fresh process."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.quantize import rewrites, routes  # noqa: E402

from quantize_models import skip_module_without_torchao  # noqa: E402

skip_module_without_torchao()

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
    return rewrites.contiguous_linear_inputs(graph), graph


def test_a_linear_on_a_non_contiguous_sequence_reads_a_contiguous_copy() -> None:
    model, x = Tagger().eval(), torch.randn(3, 4, 8)
    copies, graph = _copies(model, x)
    assert copies == 1
    clones = [n for n in graph.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert [user.target for user in clones[0].users] == [torch.ops.aten.linear.default]
    with torch.no_grad():
        assert torch.equal(graph(x), model(x))
    assert _copies(tiny_mlp().eval(), torch.randn(3, 16))[0] == 0   # contiguous inputs: nothing added


class Offset(nn.Module):
    """A Linear plus a bias-like buffer of its width (8), which is also the example's batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 8)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset


def test_a_lower_rank_addend_of_a_linear_is_viewed_to_its_rank() -> None:
    model, x = Offset().eval(), torch.randn(8, 16)
    graph = routes.export(model, (x,)).module()
    assert rewrites.full_rank_linear_adds(graph) == 1
    views = [n for n in graph.graph.nodes if n.target is torch.ops.aten.reshape.default]
    assert views and views[0].args[1] == [1, 8]
    with torch.no_grad():
        assert torch.equal(graph(x), model(x))
    assert rewrites.full_rank_linear_adds(routes.export(tiny_mlp().eval(), (torch.randn(3, 16),)).module()) == 0


def _check(model: nn.Module, quantized: object, x: torch.Tensor, mode: str) -> None:
    with torch.no_grad():
        for rows in (x, x[:3]):
            ref, out = model(rows), quantized(rows)
            assert out.shape == ref.shape and (ref - out).abs().max() <= MAX_ERROR[mode] * ref.abs().max()


def test_pt2e_routes_build_after_a_gru_and_with_a_bias_buffer_and_save(tmp_path) -> None:
    skip_without_inductor()
    tagger, x = Tagger().eval(), torch.randn(4, 6, 8)
    with pytest.warns(QuantizeWarning, match="rnn: GRU has no INT8 route here"):
        gru = quantize(tagger, x, mode="dynamic", progress=False)
    report = gru.report
    assert (gru.mode, report.quantized, list(report.kept_fp32)) == ("dynamic", ["head"], ["rnn"])
    _check(tagger, gru, x, "dynamic")
    offset, rows = Offset().eval(), torch.randn(8, 16)
    static = quantize(offset, rows, calibration=[(rows,)], mode="static", progress=False)
    assert static.report.quantized == ["linear"] and static._runner.how == "dynamic"
    assert routes.unbacked_batch_fails(static._runner.module)   # dynamic at once, not after a failed compile
    _check(offset, static, rows, "static")
    save_then_load(tmp_path, {"dynamic_gru": (gru, x), "static_offset": (static, rows)}, {})
