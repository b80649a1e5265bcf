"""Decisions, no effects: validated options (:mod:`.options`), the plan as data (:mod:`.records`),
the planner (:mod:`.planner`: machine x options -> instances), each instance's environment (:mod:`.environment`), cores kept
for communication (:mod:`.reserve`), and how a plan is printed (:mod:`.show`)."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_LAZY = {
    "plan": "xlaunch.launcher.plan.planner",
    "Plan": "xlaunch.launcher.plan.records",
    "Instance": "xlaunch.launcher.plan.records",
    "Options": "xlaunch.launcher.plan.options",
    "build_options": "xlaunch.launcher.plan.options",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
