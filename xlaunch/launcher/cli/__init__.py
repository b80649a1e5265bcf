"""The command line: one option table (:mod:`.spec`), a fast parser for common command lines
(:mod:`.parse`), click for help, errors and completion (:mod:`.click_command`), ipexrun and
run_cpu spellings (:mod:`.compat`), and the command itself (:mod:`.command`)."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_LAZY = {
    "main": "xlaunch.launcher.cli.command",
    "run": "xlaunch.launcher.cli.command",
    "format_plan": "xlaunch.launcher.cli.command",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
