"""The bundled optimizer library: ``optimize`` (inference/training model rewrites) and fused
optimizers with split-bf16 master weights, and
INT8 ``quantize``/``load_quantized``. Imports torch lazily, on first attribute use."""
from __future__ import annotations

from typing import Any

from xlaunch._torch import load_attribute

_LAZY = {
    "optimize": "xlaunch.kernels.optimize",
    "FusedSGD": "xlaunch.kernels.optim",
    "FusedAdagrad": "xlaunch.kernels.optim",
    "FusedAdam": "xlaunch.kernels.optim",
    "FusedAdamW": "xlaunch.kernels.optim",
    "FusedLamb": "xlaunch.kernels.optim",
    "to_fused": "xlaunch.kernels.optim",
    "quantize": "xlaunch.kernels.quantize",
    "load_quantized": "xlaunch.kernels.quantize",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xlaunch.kernels' has no attribute {name!r}")
    value = load_attribute(module, name, f"xlaunch.kernels.{name}")
    globals()[name] = value
    return value
