"""DLRM's feature interaction: the dense feature and the pairwise dot products of all features.

``interaction(dense, *sparse)`` with ``F = 1 + len(sparse)`` features of shape ``(batch, dim)``
returns ``(batch, dim + F * (F - 1) / 2)``: the dense feature, then ``<x_i, x_j>`` for every
``j < i`` in row-major order (the strictly lower triangle of ``X X^T``, DLRM's ``li, lj``).

One autograd function instead of eager's ``cat`` + ``bmm`` + advanced-index gather: the features
are stacked with ``cat`` along dim 1 and a view (``torch.stack`` along dim 1 measured 5x slower
here), the forward takes the triangle with one ``gather``; the backward scatters the upstream
gradient into both triangles of one ``(F, F)`` matrix per sample (``dZ + dZ^T`` in one step) and
needs a single ``bmm`` (eager autograd runs two, one per ``bmm`` operand).
"""
from __future__ import annotations

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import Tensor

__all__ = ["interaction", "InteractionFunc"]

_pairs: dict[int, tuple[Tensor, Tensor]] = {}
_NARROW = (torch.bfloat16, torch.float16)


def _triangle(features: int) -> tuple[Tensor, Tensor]:
    """Flat positions ``i * F + j`` of the strictly lower triangle (j < i), and of its mirror."""
    found = _pairs.get(features)
    if found is None:
        rows, cols = torch.tril_indices(features, features, offset=-1)
        found = (rows * features + cols, cols * features + rows)
        _pairs[features] = found
    return found


class _Interaction(torch.autograd.Function):
    """The interaction of the features stacked as ``flat`` ``(batch, count * dim)``: an input, so
    the backward's ops on it are differentiable (a double backward is right) and torch.compile
    saves no view of an intermediate."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)     # the dtype was chosen by interaction(); bmm is not recast
    def forward(ctx, flat: Tensor, count: int) -> Tensor:
        batch, dim = flat.shape[0], flat.shape[1] // count
        stacked = flat.view(batch, count, dim)
        lower, _ = _triangle(count)
        wide = stacked.float() if stacked.dtype in _NARROW else stacked    # fp32 sums for 16-bit floats
        dots = torch.bmm(wide, wide.transpose(1, 2)).view(batch, count * count)
        out = torch.empty(batch, dim + lower.numel(), dtype=stacked.dtype)
        out[:, :dim] = flat[:, :dim]
        out[:, dim:] = torch.gather(dots, 1, lower.expand(batch, -1))
        ctx.save_for_backward(flat)
        ctx.count = count
        return out

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, grad: Tensor) -> tuple:
        (flat,) = ctx.saved_tensors
        batch, count = flat.shape[0], ctx.count
        dim = flat.shape[1] // count
        stacked = flat.view(batch, count, dim)
        lower, upper = _triangle(count)
        compute = torch.float32 if stacked.dtype in _NARROW else stacked.dtype
        pair_grad = grad[:, dim:].to(compute)
        symmetric = torch.zeros(batch, count * count, dtype=compute)
        both = torch.cat([lower, upper]).expand(batch, -1)
        symmetric.scatter_(1, both, torch.cat([pair_grad, pair_grad], dim=1))
        feature_grad = torch.bmm(symmetric.view(batch, count, count), stacked.to(compute))   # (B, F, D)
        feature_grad[:, 0] += grad[:, :dim].to(compute)
        return feature_grad.to(stacked.dtype).view(batch, count * dim), None


class InteractionFunc:
    """``ipex.nn``'s name for the autograd function behind :func:`interaction`:
    ``InteractionFunc.apply(dense, *sparse)`` is ``interaction(dense, *sparse)``."""

    @staticmethod
    def apply(*features: Tensor) -> Tensor:
        """:func:`interaction` (its checks too: features of another width were split at the wrong
        place, silently, into ``len(features)`` equal vectors)."""
        return interaction(*features)


def _interact(features: list) -> Tensor:
    return _Interaction.apply(torch.cat(features, dim=1), len(features))


def interaction(*features: Tensor) -> Tensor:
    """``(batch, dim + F(F-1)/2)``: the first (dense) feature, then the pairwise dot products of
    all ``F`` features (each ``(batch, dim)``, one float dtype; fp64 computes in fp64, bf16 and
    fp16 sum in fp32 and round once). Under CPU autocast, IPEX's rule: every feature is cast to the
    type promoted from the autocast dtype and theirs (bf16 and fp32 features: fp32; all bf16: bf16)."""
    if not features:
        raise ValueError("interaction needs at least the dense feature")
    first = features[0]
    for number, feature in enumerate(features):
        if not isinstance(feature, Tensor):
            raise TypeError(f"interaction: feature {number} must be a (batch, dim) tensor, not {type(feature).__name__}")
        if feature.dim() != 2 or feature.shape != first.shape:
            raise ValueError(f"interaction: feature {number} must be a (batch, dim) tensor shaped like the dense "
                             f"feature {tuple(first.shape)}")
        if not feature.dtype.is_floating_point:
            raise TypeError(f"interaction: feature {number} is {feature.dtype}; the features must be a float dtype")
    if torch.is_autocast_enabled("cpu"):
        target = torch.get_autocast_dtype("cpu")
        for feature in features:
            target = torch.promote_types(target, feature.dtype)
        return _interact([feature.to(target) for feature in features])
    for number, feature in enumerate(features):
        if feature.dtype != first.dtype:
            raise ValueError(f"interaction: feature {number} is {feature.dtype}, the dense feature {first.dtype}")
    return _interact(list(features))
