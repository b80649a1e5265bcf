"""Linear layers with packed weights: bf16, fp32, weight-only INT8 (per output channel) and INT4 (group-wise).

:class:`PackedLinear` holds one weight in the layout its kernel reads and computes
``y = x @ W.T + b`` in the activation dtype (fp32 accumulation). Several ``nn.Linear`` of one input
(q, k and v; gate and up) can be packed into one, so one call reads all their weights.

Quantization (round to nearest):
* ``int8``: symmetric per output channel, ``scale[n] = max|W[n, :]| / 127``, ``q = round(W / scale)``.
* ``int4``: symmetric per group of ``group_size`` inputs, ``scale[n, g] = max|W[n, g]| / 7``,
  ``q = clamp(round(W / scale), -8, 7)``.
"""
from __future__ import annotations

from typing import Optional, Sequence

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

KINDS = ("fp32", "bf16", "int8", "int4")
GROUP_SIZES = (32, 64, 128)


def quantize_int8(weight: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(int8 [N, K], fp32 scales [N]) of a float weight, symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: "torch.Tensor", group_size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(int8 values in [-8, 7] of shape [N, K], fp32 scales [N, K // group_size]), symmetric per group."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the INT4 group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    scale = w.abs().amax(dim=2).clamp(min=1e-12) / 7.0
    q = torch.round(w / scale[:, :, None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(n, k), scale


def dequantize(q: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    """The fp32 weight a quantized one stands for (scales per row, or per row and group)."""
    n, k = q.shape
    groups = scale.reshape(n, -1).shape[1]
    return (q.float().reshape(n, groups, k // groups) * scale.reshape(n, groups, 1)).reshape(n, k)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W packed as ``kind``; inference only (no autograd)."""

    def __init__(self, weight: "torch.Tensor", bias: Optional["torch.Tensor"], kind: str,
                 dtype: "torch.dtype" = torch.bfloat16, group_size: int = 128) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"weights must be one of {', '.join(KINDS)}, not {kind!r}")
        if kind == "int4" and group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, not {group_size}")
        self.kind, self.dtype, self.group_size = kind, dtype, group_size
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())
        if kind in ("fp32", "bf16"):
            self.register_buffer("weight", weight.detach().to(torch.float32 if kind == "fp32" else torch.bfloat16).contiguous())
            self.register_buffer("scales", None)
        elif kind == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("weight", q)
            self.register_buffer("scales", scale)
        else:
            q, scale = quantize_int4(weight, group_size)
            self.register_buffer("weight", q)
            self.register_buffer("scales", scale)

    @classmethod
    def from_linears(cls, linears: Sequence["nn.Linear"], kind: str, dtype: "torch.dtype" = torch.bfloat16,
                     group_size: int = 128) -> "PackedLinear":
        """One packed layer computing the outputs of ``linears`` (same input) concatenated."""
        weight = torch.cat([layer.weight.detach() for layer in linears], dim=0)
        biases = [layer.bias for layer in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else torch.zeros(l.out_features, dtype=l.weight.dtype)
                              for b, l in zip(biases, linears)])
        return cls(weight, bias, kind, dtype=dtype, group_size=group_size)

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, weights={self.kind}, "
                f"dtype={self.dtype}{extra}, bias={self.bias is not None}")

    def dense_weight(self) -> "torch.Tensor":
        """The weight as an fp32 [N, K] tensor (dequantized)."""
        if self.scales is None:
            return self.weight.float()
        return dequantize(self.weight, self.scales)

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        """Reference path: dequantize and multiply (the kernels give the same results faster)."""
        weight = self.weight if self.scales is None else self.dense_weight()
        y = torch.nn.functional.linear(x.to(weight.dtype), weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)
