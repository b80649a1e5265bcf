"""Fused optimizers (:mod:`.fused`) with split-bf16 master weights (:mod:`.splitbf16`; their
state in checkpoints: :mod:`.splitstate`)."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_LAZY = {
    "FusedSGD": "xlaunch.kernels.optim.fused",
    "FusedAdagrad": "xlaunch.kernels.optim.fused",
    "FusedAdam": "xlaunch.kernels.optim.fused",
    "FusedAdamW": "xlaunch.kernels.optim.fused",
    "FusedLamb": "xlaunch.kernels.optim.fused",
    "to_fused": "xlaunch.kernels.optim.fused",
    "master_params": "xlaunch.kernels.optim.fused",
    "split_params": "xlaunch.kernels.optim.fused",
    "is_split": "xlaunch.kernels.optim.fused",
    "TRAIL_KEY": "xlaunch.kernels.optim.fused",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
