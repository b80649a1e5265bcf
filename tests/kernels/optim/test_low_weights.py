"""The forward of a split-bf16 (or bf16 inference) model follows its parameters' dtype: bf16 autocast
while one is bf16/fp16, the plain precision once none is. It scanned every parameter on each forward
(the whole module tree once widened); it now tests one number and keeps
following every way the dtype changes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels import to_fused  # noqa: E402
from xlaunch.kernels.optim.fused import is_split  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


class Counted(nn.Sequential):
    """Counts the calls of ``parameters()`` (a scan of the whole model)."""

    scans = 0

    def parameters(self, recurse: bool = True):  # type: ignore[override]
        Counted.scans += 1
        return super().parameters(recurse)


def _split_model(layers: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Counted(*[nn.Linear(8, 8) for _ in range(layers)]).train()
    optimizer = to_fused(torch.optim.SGD(model.parameters(), lr=0.1), model, dtype=torch.bfloat16)
    assert is_split(optimizer, model[0].weight)
    return model, optimizer


def _autocast(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether the forward ran under bf16 autocast: fp32 inputs into bf16/fp16 weights fail without."""
    with torch.no_grad():
        try:
            out = model(x)
        except RuntimeError as exc:
            assert "dtype" in str(exc) or "type" in str(exc), exc
            return False
    assert out.dtype == torch.float32
    plain = x
    for layer in model:
        plain = nn.functional.linear(plain, layer.weight.float(), layer.bias.float())
    return not torch.equal(out, plain)   # bf16 rounding of the activations under autocast


def test_the_forward_does_not_scan_the_parameters_each_call() -> None:
    model, _ = _split_model()
    x = torch.randn(2, 8)
    for widen in (False, True):
        if widen:
            model.float()
        model(x)
        Counted.scans = 0
        for _ in range(5):
            model(x)
        assert Counted.scans == 0, f"{Counted.scans} scans in 5 forwards (widened: {widen})"


def test_the_forward_follows_every_dtype_change() -> None:
    model, optimizer = _split_model()
    x = torch.randn(2, 8)
    assert _autocast(model, x)
    model.float()                                      # widened: the plain fp32 model of the masters
    assert not _autocast(model, x) and not is_split(optimizer, model[0].weight)
    model.to(torch.bfloat16)
    assert _autocast(model, x)
    model.float()
    assert not _autocast(model, x)
    model.half()
    assert _autocast(model, x)
    model.float()
    model[1].bfloat16()                                # a part of the model only
    assert _autocast(model, x)
    model[1].float()
    assert not _autocast(model, x)
    model[2] = nn.Linear(8, 8).bfloat16()              # a module assigned
    assert _autocast(model, x)
    model[2].float()
    model[0].weight = nn.Parameter(model[0].weight.detach().bfloat16())   # a parameter assigned
    assert _autocast(model, x)
    model[0].float()
    assert not _autocast(model, x)
    bf16 = {key: value.bfloat16() for key, value in model.state_dict().items()}
    model.load_state_dict(bf16, assign=True)           # takes the checkpoint's dtype
    assert _autocast(model, x)
    model.load_state_dict({key: value.float() for key, value in bf16.items()}, assign=True)
    assert not _autocast(model, x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # assign=True made new parameters
    to_fused(optimizer, model, dtype=torch.bfloat16)   # split again (``.data`` made bf16)
    assert _autocast(model, x)
    model[0].weight.data = model[0].weight.data.float()   # the witness widened by hand: looked at again
    assert _autocast(model, x)
