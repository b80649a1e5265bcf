"""Effects: the runner's lifecycle (:mod:`.runner`), starting pinned instances (:mod:`.spawning`,
:mod:`.binding`), the watchdog that outlives a killed launcher (:mod:`.watchdog`), log files
(:mod:`.logfiles`) and the prefixed console (:mod:`.console`)."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_LAZY = {
    "run_plan": "xlaunch.launcher.run.runner",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
