"""The machine a plan is for: this one, or a recording named by ``XLAUNCH_FSROOT`` (which can
only be planned for and printed, never run on)."""
from __future__ import annotations

import os

from xlaunch.launcher.errors import OptionError

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Mapping

    from xlaunch.machine.model import Machine


def target_machine(environ: Mapping[str, str]) -> Machine:
    """Read the machine once; a bad ``XLAUNCH_FSROOT`` is an :class:`OptionError` naming it."""
    from xlaunch.machine import MachineRootError, load_machine, recorded_root_problem

    root = environ.get("XLAUNCH_FSROOT") or None
    try:
        machine = load_machine(root)
    except MachineRootError as exc:
        raise OptionError("XLAUNCH_FSROOT", str(exc)) from None
    if not is_live(machine):
        problem = recorded_root_problem(machine.root)
        if problem is not None:
            raise OptionError("XLAUNCH_FSROOT", problem)
    return machine


def is_live(machine: Machine) -> bool:
    """Whether ``machine`` is this one (root ``/``), not a recording."""
    return os.path.realpath(machine.root) == "/"


def refuse_recorded(machine: Machine, dry_run: bool) -> None:
    """A recorded machine's plans can be printed, not run."""
    if not dry_run and not is_live(machine):
        raise OptionError("XLAUNCH_FSROOT", f"{machine.root} is a recorded machine: its plans can only be "
                                            "printed (add --dry-run)")
