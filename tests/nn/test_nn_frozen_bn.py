"""FrozenBatchNorm2d: torchvision's formula, memory format and dtype kept, checkpoints of a
BatchNorm2d load, and optimize() folds it (and torchvision's class, recognized by its buffers)
into the convolution before it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import xlaunch  # noqa: E402
from xlaunch.kernels.optimize import fold  # noqa: E402
from xlaunch.nn import FrozenBatchNorm2d  # noqa: E402

pytestmark = pytest.mark.torch


def randomized(norm: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    n = norm.running_mean.numel()
    with torch.no_grad():
        for name, low, high in (("weight", 0.5, 1.5), ("bias", -1, 1), ("running_mean", -1, 1), ("running_var", 0.5, 2)):
            getattr(norm, name).copy_(torch.rand(n, generator=gen) * (high - low) + low)
    return norm


def torchvision_formula(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    scale = norm.weight * (norm.running_var + norm.eps).rsqrt()
    shift = norm.bias - norm.running_mean * scale
    return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


class FrozenBatchNorm2dAsInTorchvision(nn.Module):
    """What torchvision.ops.FrozenBatchNorm2d holds (its wheel does not load with this torch)."""

    def __init__(self, n: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, value in (("weight", torch.ones(n)), ("bias", torch.zeros(n)), ("running_mean", torch.zeros(n)),
                            ("running_var", torch.ones(n))):
            self.register_buffer(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torchvision_formula(self, x)


def test_formula_memory_format_dtype_and_gradient():
    norm = randomized(FrozenBatchNorm2d(6, eps=1e-3))
    x = torch.randn(2, 6, 5, 7, requires_grad=True)
    torch.testing.assert_close(norm(x), torchvision_formula(norm, x))
    last = norm(x.detach().to(memory_format=torch.channels_last))
    assert last.is_contiguous(memory_format=torch.channels_last)
    half = norm(x.detach().bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), torchvision_formula(norm, x.detach()), rtol=2e-2, atol=2e-2)
    norm(x).sum().backward()                       # frozen: the gradient reaches the input only
    assert x.grad is not None and list(norm.parameters()) == []


def test_a_batchnorm_checkpoint_loads():
    source = randomized(nn.BatchNorm2d(4))
    frozen = FrozenBatchNorm2d(4)
    frozen.load_state_dict(source.state_dict())    # num_batches_tracked is dropped
    x = torch.randn(1, 4, 3, 3)
    torch.testing.assert_close(frozen(x), source.eval()(x))
    torch.testing.assert_close(FrozenBatchNorm2d.from_batch_norm(source)(x), source(x))


@pytest.mark.parametrize("norm_class", [FrozenBatchNorm2d, FrozenBatchNorm2dAsInTorchvision])
def test_optimize_folds_it_into_the_conv_and_keeps_channels_last(norm_class):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), randomized(norm_class(8)), nn.ReLU()).eval()
    assert fold.is_frozen_norm(model[1]) and not fold.is_frozen_norm(nn.BatchNorm2d(8))
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        want = model(x)
        optimized = xlaunch.optimize(model, sample_input=x, weights_prepack=False, measure=False)
        got = optimized(x.to(memory_format=torch.channels_last))
    assert optimized._xlaunch_optimize_report.folded == ["0+1"]
    assert isinstance(optimized[1], nn.Identity)
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_input_and_buffers_of_other_float_dtypes_promote_as_torchvisions_formula():
    norm = randomized(FrozenBatchNorm2d(5, eps=1e-3))
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64, requires_grad=True)
    out = norm(x)                                  # fp32 buffers, fp64 input ("mixed dtype" before)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torchvision_formula(norm, x), rtol=1e-6, atol=1e-6)   # its scale is fp32
    assert torch.autograd.gradcheck(norm, (x,))
    half = randomized(FrozenBatchNorm2d(5)).to(torch.bfloat16)           # bf16 buffers, fp32 input
    wide = FrozenBatchNorm2d(5)
    wide.load_state_dict({name: value.float() for name, value in half.state_dict().items()})
    torch.testing.assert_close(half(x.detach().float()), torchvision_formula(wide, x.detach().float()))
    scripted = torch.jit.script(norm)              # still scriptable, as torchvision's class
    torch.testing.assert_close(scripted(x.detach()), out.detach())


def test_bad_input_is_one_line_naming_the_problem():
    norm = FrozenBatchNorm2d(3)
    with pytest.raises(ValueError, match=r"FrozenBatchNorm2d\(3\): input has 4 channels"):
        norm(torch.randn(1, 4, 2, 2))
    with pytest.raises(TypeError, match="must be a float tensor, not torch.int64"):
        norm(torch.ones(1, 3, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="got 3-D"):
        norm(torch.ones(3, 2, 2))


def test_from_batch_norm_refuses_a_norm_without_running_statistics():
    # It froze mean 0 / variance 1 in their place: outputs 23 off the norm's own on shifted data.
    with pytest.raises(ValueError, match="no running statistics"):
        FrozenBatchNorm2d.from_batch_norm(nn.BatchNorm2d(3, track_running_stats=False))
    plain = nn.BatchNorm2d(3, affine=False).eval()                 # no affine: the frozen weight 1, bias 0
    x = torch.randn(2, 3, 4, 4) * 5 + 3
    torch.testing.assert_close(FrozenBatchNorm2d.from_batch_norm(plain)(x), plain(x))
