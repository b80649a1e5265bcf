"""Memory layout: channels-last weights for convolution models.

Only convolution weights are converted (4-D to ``channels_last``, 5-D to ``channels_last_3d``);
oneDNN then picks the channels-last kernels and produces channels-last activations even for a
plain NCHW input, so callers need not convert their inputs. Values are unchanged.
"""
from __future__ import annotations

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
