"""The functional forms (``ipex.nn.functional``'s names): :func:`interaction`, :func:`roi_align`."""
from __future__ import annotations

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    from xlaunch.nn.feature_interaction import InteractionFunc, interaction
    from xlaunch.nn.roi import roi_align

__all__ = ["interaction", "InteractionFunc", "roi_align"]
