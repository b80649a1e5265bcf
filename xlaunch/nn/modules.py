"""The module classes where ``ipex.nn.modules`` holds them: ``xlaunch.nn.modules.MergedEmbeddingBag``
is ``xlaunch.nn.MergedEmbeddingBag`` (and ``_roi_align.RoIAlign``, IPEX's private path, resolves too).
Loads nothing until a name is used."""
from __future__ import annotations

import importlib

from xlaunch._lazy import lazy_exports

_LAZY = {
    "EmbeddingSpec": "xlaunch.nn.tables",
    "MergedEmbeddingBag": "xlaunch.nn.merged",
    "MergedEmbeddingBagWithSGD": "xlaunch.nn.merged",
    "MergedEmbeddingBagWithAdaGrad": "xlaunch.nn.merged",
    "MergedEmbeddingBagWithCat": "xlaunch.nn.merged",
    "DistMergeEmbeddingBagWithAdaGrad": "xlaunch.nn.dist_merged",
    "FrozenBatchNorm2d": "xlaunch.nn.frozen_bn",
    "RoIAlign": "xlaunch.nn.roi",
}

__all__ = list(_LAZY)

_exported, __dir__ = lazy_exports(__name__, _LAZY)


def __getattr__(name: str) -> object:
    if name == "_roi_align":   # ipex.nn.modules._roi_align.RoIAlign
        return importlib.import_module("xlaunch.nn.roi")
    return _exported(name)
