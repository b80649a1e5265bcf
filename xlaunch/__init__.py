"""xlaunch: CPU performance launcher and runtime-tuning toolkit for stock PyTorch.

``import xlaunch`` is light: the runtime and kernel APIs are loaded on first use, and
nothing here imports torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "CPUPool": "xlaunch.runtime_ext",
    "pin": "xlaunch.runtime_ext",
    "Task": "xlaunch.runtime_ext",
    "MultiStreamModule": "xlaunch.runtime_ext",
    "MultiStreamModuleHint": "xlaunch.runtime_ext",
    "get_core_list_of_node_id": "xlaunch.runtime_ext",
    "is_runtime_ext_enabled": "xlaunch.runtime_ext",
    "optimize": "xlaunch.kernels",
    "quantize": "xlaunch.kernels",
    "load_quantized": "xlaunch.kernels",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xlaunch' has no attribute {name!r}")
    from xlaunch._torch import load_attribute

    value = load_attribute(module, name, f"xlaunch.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
