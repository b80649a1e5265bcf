"""Where a warning points: at the first frame outside the library's own packages, the user's line."""
from __future__ import annotations

import sys


def stacklevel_outside(*packages: str) -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the first frame
    whose module is none of ``packages`` and in none of them (``"xlaunch.kernels"``; ``"xlaunch", "torch"``),
    however deep the call came from (a model's forward through ``nn.Module.__call__``, a loader)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _within(frame.f_globals.get("__name__", ""), packages):
        frame, level = frame.f_back, level + 1
    return level


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)
