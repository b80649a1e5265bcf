"""``FrozenBatchNorm2d``: batch norm with fixed statistics and affine parameters (torchvision's).

The four tensors are buffers (no parameter trains), so the layer is the same in training and in
eval, and :func:`xlaunch.optimize` folds it into the convolution before it like an eval-mode
``BatchNorm2d`` (``kernels/optimize/fold.py`` recognizes frozen norms by their buffers, also
torchvision's own class). The forward is ``F.batch_norm`` in inference mode: one pass, memory
format kept (channels-last in, channels-last out), bf16 inputs with fp32 statistics.
"""
from __future__ import annotations

from typing import Any

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

from xlaunch._errors import real_number, whole_number

__all__ = ["FrozenBatchNorm2d"]


class FrozenBatchNorm2d(nn.Module):
    """``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias`` per channel, with
    buffers ``weight``, ``bias``, ``running_mean``, ``running_var`` (torchvision's semantics)."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features = num_features = whole_number(num_features, "FrozenBatchNorm2d: num_features")
        self.eps = real_number(eps, "FrozenBatchNorm2d: eps", 0.0)
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    @classmethod
    def from_batch_norm(cls, norm: nn.modules.batchnorm._BatchNorm) -> "FrozenBatchNorm2d":
        """A frozen copy of a ``BatchNorm2d``'s statistics and affine parameters (``ValueError`` for
        one without running statistics: it normalizes by each batch's, which nothing here can freeze)."""
        if norm.running_mean is None or norm.running_var is None:
            raise ValueError("FrozenBatchNorm2d.from_batch_norm: the norm has no running statistics "
                             "(track_running_stats=False): it normalizes by each batch's own")
        frozen = cls(norm.num_features, norm.eps)
        with torch.no_grad():
            if norm.affine:
                frozen.weight.copy_(norm.weight)
                frozen.bias.copy_(norm.bias)
            frozen.running_mean.copy_(norm.running_mean)
            frozen.running_var.copy_(norm.running_var)
        return frozen

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        state_dict.pop(prefix + "num_batches_tracked", None)   # checkpoints of a BatchNorm2d load too
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x: Tensor) -> Tensor:
        """In ``x``'s dtype and memory format; the statistics in ``x``'s dtype, or fp32 for bf16 and
        fp16 input (``F.batch_norm`` refuses other mixes, e.g. fp64 input with fp32 buffers, which
        torchvision's formula promotes). Scriptable, as torchvision's."""
        if not isinstance(x, Tensor):
            raise TypeError("FrozenBatchNorm2d expects an (N, C, H, W) tensor")
        if x.dim() != 4:
            raise ValueError(f"FrozenBatchNorm2d expects (N, C, H, W) input, got {x.dim()}-D")
        if not x.is_floating_point():
            raise TypeError(f"FrozenBatchNorm2d: input must be a float tensor, not {x.dtype}")
        if x.shape[1] != self.num_features:
            raise ValueError(f"FrozenBatchNorm2d({self.num_features}): input has {x.shape[1]} channels")
        stats = [self.running_mean, self.running_var, self.weight, self.bias]
        want = torch.float32 if x.dtype == torch.bfloat16 or x.dtype == torch.float16 else x.dtype
        for t in stats:
            if t.dtype != want and t.dtype != x.dtype:
                stats = [s.to(want) for s in stats]
                break
        return F.batch_norm(x, stats[0], stats[1], stats[2], stats[3], False, 0.0, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"
