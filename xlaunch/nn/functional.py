"""The functional forms (``ipex.nn.functional``'s names): :func:`interaction`, :func:`roi_align`."""
from __future__ import annotations

from xlaunch.nn.interaction import InteractionFunc, interaction
from xlaunch.nn.roi_align import roi_align

__all__ = ["interaction", "InteractionFunc", "roi_align"]
