"""Module paths from before the rooms (0.1 layout) keep working: ``import xlaunch.launcher.runner``
gives ``xlaunch.launcher.run.runner`` (the same module object, so patches reach it) with a
``DeprecationWarning`` naming the new path. The finder (``xlaunch._MovedModules``) goes first on
``sys.meta_path`` (a submodule of a moved package, ``xlaunch.launcher.machine.record``, would
otherwise load twice under two names) and imports this module only for a moved name."""
from __future__ import annotations

_L, _K = "xlaunch.launcher", "xlaunch.kernels"
MOVED = {
    f"{_L}.machine": "xlaunch.machine",
    f"{_L}.report": "xlaunch.machine.report",
    f"{_L}.cli_click": f"{_L}.cli.click_command",
    f"{_L}.cli_parse": f"{_L}.cli.parse",
    f"{_L}.cli_spec": f"{_L}.cli.spec",
    f"{_L}.compat": f"{_L}.cli.compat",
    f"{_L}.options": f"{_L}.plan.options",
    f"{_L}.environment": f"{_L}.plan.environment",
    f"{_L}.which": f"{_L}.plan.which",
    f"{_L}.binding": f"{_L}.run.binding",
    f"{_L}.runner": f"{_L}.run.runner",
    f"{_L}.spawning": f"{_L}.run.spawning",
    f"{_L}.watchdog": f"{_L}.run.watchdog",
    f"{_L}.logfiles": f"{_L}.run.logfiles",
    f"{_L}.output": f"{_L}.run.console",
    f"{_L}.summary": f"{_L}.observe.summary",
    f"{_L}.probe": f"{_L}.observe.probe",
    f"{_L}.ranks": f"{_L}.distributed.ranks",
    f"{_K}.autooptimize": f"{_K}.inject.hooks",
    f"{_K}._inject": f"{_K}.inject.site",
    f"{_K}.splitbf16": f"{_K}.optim.splitbf16",
    f"{_K}.splitstate": f"{_K}.optim.splitstate",
    f"{_K}.quantize_routes": f"{_K}.quantize.routes",
    f"{_K}.quantize_policy": f"{_K}.quantize.policy",
    "xlaunch.llm.arch": "xlaunch.llm.shapes",
    **{f"{_K}.{name}": f"{_K}.optimize.{name}"
       for name in ("compare", "dispatch", "fold", "freeze", "layout", "measure", "notes", "precision")},
}


def new_name(old: str) -> str | None:
    """Where ``old`` lives now (its moved package's submodules included), or None."""
    if old in MOVED:
        return MOVED[old]
    package, _, child = old.rpartition(".")
    parent = new_name(package) if package else None
    return f"{parent}.{child}" if parent else None


class _Alias:
    """Loader that hands out the module at its new path."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: object) -> object:
        import importlib
        import warnings

        warnings.warn(f"{self.old} moved to {self.new}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module: object) -> None:
        """Already executed at its new path."""


def find_spec(name: str) -> object:
    """A spec that loads ``name``'s new module under the old name, or None (not moved)."""
    new = new_name(name)
    if new is None:
        return None
    import importlib.util

    if importlib.util.find_spec(new) is None:
        return None
    from importlib.machinery import ModuleSpec

    return ModuleSpec(name, _Alias(name, new))
