"""One answer to "torch is not installed": an ImportError that names the extra to install.

The lazy exports of :mod:`xlaunch`, :mod:`xlaunch.runtime_ext` and :mod:`xlaunch.kernels` load
their modules through :func:`load_attribute`, so ``xlaunch.optimize`` or
``xlaunch.MultiStreamModule`` without torch says what to do instead of
``ModuleNotFoundError: No module named 'torch'``. Imports nothing heavy.
"""
from __future__ import annotations

import importlib

INSTALL = 'pip install "xlaunch[torch]"'


def missing_torch_message(what: str) -> str:
    """The one message: ``what`` needs torch, and how to get it."""
    return f"{what} needs PyTorch, which is not installed here: {INSTALL}"


def torch_installed() -> bool:
    """Whether ``import torch`` can find a torch (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _is_torch(name: object) -> bool:
    return isinstance(name, str) and (name == "torch" or name.startswith("torch."))


def load_attribute(module: str, name: str, what: str) -> object:
    """``getattr(import_module(module), name)``; torch missing becomes one ImportError naming
    ``what`` and the extra to install (also when a nested lazy export raised it first).

    Any other missing module (a bug, or another optional dependency) propagates unchanged.
    """
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        if not _is_torch(exc.name):
            raise
        raise ImportError(missing_torch_message(what), name="torch") from None
