"""Memory layout: channels-last weights for convolution models.

Only convolution weights are converted (4-D to ``channels_last``, 5-D to ``channels_last_3d``);
oneDNN then picks the channels-last kernels and produces channels-last activations even for a
plain NCHW input, so callers need not convert their inputs. Values are unchanged.
"""
from __future__ import annotations

from typing import Sequence

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

CONV_ND = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def has_conv(model: nn.Module) -> bool:
    """True when the model holds a 2-D or 3-D convolution (where channels-last pays)."""
    return any(isinstance(m, CONV_ND) for m in model.modules())


def to_channels_last(model: nn.Module) -> int:
    """Convert conv weights in place (``.data``, so parameters keep their identity); return how many."""
    converted = 0
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, CONV_ND) or id(module) in seen:
            continue
        seen.add(id(module))
        weight = module.weight
        fmt = torch.channels_last if weight.dim() == 4 else torch.channels_last_3d
        weight.data = weight.data.contiguous(memory_format=fmt)
        converted += 1
    return converted


def input_to_channels_last(sample: object) -> object:
    """A sample tensor in the layout the converted model prefers (others returned as given)."""
    if isinstance(sample, torch.Tensor) and sample.dim() in (4, 5):
        fmt = torch.channels_last if sample.dim() == 4 else torch.channels_last_3d
        return sample.contiguous(memory_format=fmt)
    return sample


def to_contiguous(model: nn.Module) -> None:
    """Undo :func:`to_channels_last` (conv weights back to the default layout, in place)."""
    for module in model.modules():
        if isinstance(module, CONV_ND):
            module.weight.data = module.weight.data.contiguous()


def match_optimizer_state(optimizer: "torch.optim.Optimizer") -> int:
    """Give each per-parameter state tensor of a parameter's shape (momentum, moments) that
    parameter's memory layout; return how many were re-laid. Fused optimizer kernels walk a
    parameter, its gradient and its state in memory order, so after :func:`to_channels_last`
    a contiguous momentum buffer carried over from before would be applied to the wrong elements."""
    changed = 0
    for param, state in optimizer.state.items():
        if not isinstance(param, torch.Tensor):
            continue
        for key, value in list(state.items()):
            if (isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() >= 4
                    and value.stride() != param.stride()):
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
                changed += 1
    return changed


# -- prepacked weights ---------------------------------------------------------------------------
# A conv through aten (``aten::conv2d`` -> ideep) holds its weight in the plain layout and reorders
# it into the layout the oneDNN kernel wants on every call (``--kernel-report``: one weight
# reorder per conv call, eager and ``torch.jit.freeze`` alike; ``torch.jit.optimize_for_inference``
# prepacks fp32 only, and runs the blocked-activation kernels). A bf16 linear runs oneDNN's matmul
# on the plain weight. The modules below hold the weight as an opaque oneDNN tensor laid out once
# for the input size seen when packing (``torch.ops.mkldnn._reorder_*_weight``, as inductor's
# freezing does) and call the oneDNN op that takes it as is. They only ever serve a frozen graph
# (:func:`xlaunch.kernels.optimize.freeze.freeze_jit` swaps them into a copy it traces); the
# user's module keeps its ``nn.Conv2d``/``nn.Linear``.


def can_prepack() -> bool:
    """Whether this torch has oneDNN's prepacking ops (CPU builds with mkldnn)."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_convolution_weight", "_convolution_pointwise",
                                        "_reorder_linear_weight", "_linear_pointwise"))


class PackedConv2d(nn.Module):
    """``nn.Conv2d`` (zeros padding, numeric padding) in ``dtype`` with its weight prepacked for
    inputs of ``input_size``; an input of another size still runs (oneDNN reorders then)."""

    def __init__(self, conv: nn.Conv2d, input_size: Sequence[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.padding = [int(p) for p in conv.padding]
        self.stride = [int(s) for s in conv.stride]
        self.dilation = [int(d) for d in conv.dilation]
        self.groups = int(conv.groups)
        self.dtype = dtype
        self.register_buffer("weight", conv.weight.detach())   # for code that reads it (not a copy)
        weight = conv.weight.detach().to(dtype)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_convolution_weight(
            weight, self.padding, self.stride, self.dilation, self.groups, [int(n) for n in input_size]))
        bias = conv.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._convolution_pointwise(x.to(self.dtype), self.packed, self.bias, self.padding,
                                                       self.stride, self.dilation, self.groups, "none", [], "")


class PackedLinear(nn.Module):
    """``nn.Linear`` in bf16/fp16 with its weight prepacked for ``rows`` input rows."""

    def __init__(self, linear: nn.Linear, rows: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("weight", linear.weight.detach())   # for code that reads it (not a copy)
        weight = linear.weight.detach().to(dtype)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, int(rows)))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")
