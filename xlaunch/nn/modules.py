"""The module classes where ``ipex.nn.modules`` holds them: ``xlaunch.nn.modules.MergedEmbeddingBag``
is ``xlaunch.nn.MergedEmbeddingBag`` (and ``_roi_align.RoIAlign``, IPEX's private path, resolves too).
Loads nothing until a name is used."""
from __future__ import annotations

import importlib

from xlaunch._lazy import lazy_exports

from xlaunch.nn import _LAZY as _PACKAGE

_LAZY = {name: module for name, module in _PACKAGE.items() if name[0].isupper()}   # the classes

__all__ = list(_LAZY)

_exported, __dir__ = lazy_exports(__name__, _LAZY)


def __getattr__(name: str) -> object:
    if name == "_roi_align":   # ipex.nn.modules._roi_align.RoIAlign
        return importlib.import_module("xlaunch.nn.roi")
    return _exported(name)
