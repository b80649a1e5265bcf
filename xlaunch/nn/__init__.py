"""Operators of recommendation and detection models, with ``ipex.nn``'s names (a port is a rename).

* :mod:`.merged`: ``MergedEmbeddingBag`` and its fused-optimizer forms ``...WithSGD``,
  ``...WithAdaGrad``, and ``...WithCat``; ``EmbeddingSpec``
* :mod:`.dist_merged`: ``DistMergeEmbeddingBagWithAdaGrad`` (rows sharded over torch.distributed ranks)
* :mod:`.feature_interaction`: DLRM's ``interaction(dense, *sparse)``
* :mod:`.frozen_bn`: ``FrozenBatchNorm2d`` (folded into the conv before it by ``optimize()``)
* :mod:`.roi`: ``roi_align`` / ``RoIAlign`` (torchvision's semantics)
* :mod:`.modules` / :mod:`.functional`: the same classes / functions where ``ipex.nn.modules`` /
  ``ipex.nn.functional`` hold them (``import xlaunch as ipex`` then runs ``ipex.nn.modules.X``)
* :mod:`.native`: the compiled kernels (``python -m xlaunch.nn.native`` builds them) and their
  pure-torch fallbacks (:mod:`.bag_torch`, :mod:`.roi_torch`)

Importing this package loads nothing; each name imports torch on first use.
"""
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
    "interaction": "xlaunch.nn.feature_interaction",
    "FrozenBatchNorm2d": "xlaunch.nn.frozen_bn",
    "roi_align": "xlaunch.nn.roi",
    "RoIAlign": "xlaunch.nn.roi",
}

__all__ = [*_LAZY, "functional", "modules"]
_SUBMODULES = ("functional", "modules")   # ipex.nn.functional's and ipex.nn.modules' places

_exported, __dir__ = lazy_exports(__name__, _LAZY)


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:   # xlaunch.nn.functional.interaction, xlaunch.nn.modules.MergedEmbeddingBag
        return importlib.import_module(f"{__name__}.{name}")
    return _exported(name)
