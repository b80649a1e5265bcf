"""xlaunch: CPU performance launcher and runtime-tuning toolkit for stock PyTorch.

``import xlaunch`` is light: the runtime and kernel APIs are loaded on first use, and
nothing here imports torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CPUPool": "xlaunch.runtime_ext",
    "pin": "xlaunch.runtime_ext",
    "Task": "xlaunch.runtime_ext",
    "MultiStreamModule": "xlaunch.runtime_ext",
    "optimize": "xlaunch.kernels",
    "quantize": "xlaunch.kernels",
    "load_quantized": "xlaunch.kernels",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xlaunch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
