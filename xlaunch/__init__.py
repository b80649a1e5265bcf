"""xlaunch: CPU performance launcher and runtime-tuning toolkit for stock PyTorch.

``import xlaunch`` is light: the runtime and kernel APIs are loaded on first use, and
nothing here imports torch.
"""
from __future__ import annotations

from xlaunch import _moved
from xlaunch._lazy import lazy_exports

_moved.install()

__version__ = "0.1.0"

_LAZY = {
    "CPUPool": "xlaunch.runtime_ext",
    "pin": "xlaunch.runtime_ext",
    "Task": "xlaunch.runtime_ext",
    "MultiStreamModule": "xlaunch.runtime_ext",
    "MultiStreamModuleHint": "xlaunch.runtime_ext",
    "get_default_num_streams": "xlaunch.runtime_ext",
    "get_core_list_of_node_id": "xlaunch.runtime_ext",
    "is_runtime_ext_enabled": "xlaunch.runtime_ext",
    "optimize": "xlaunch.kernels",
    "quantize": "xlaunch.kernels",
    "load_quantized": "xlaunch.kernels",
}

__all__ = ["__version__", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
