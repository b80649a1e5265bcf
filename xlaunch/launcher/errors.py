"""The launcher's input errors: each names the option at fault and the problem, in one line.

The CLI prints ``xlaunch: error: <option>: <problem>`` on stderr and exits with status 2
before anything is started.
"""
from __future__ import annotations

USAGE_EXIT_STATUS = 2


class LaunchInputError(ValueError):
    """Bad input for the launcher (an option, the config file, the program)."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option}: {problem}")
        self.option = option
        self.problem = problem

    def line(self) -> str:
        """The one line the CLI prints for this error."""
        return f"xlaunch: error: {self.option}: {self.problem}"


class OptionError(LaunchInputError):
    """An option value (or a combination of options) that cannot be used."""


class PlanError(LaunchInputError):
    """Options that are valid on their own but impossible on this machine."""
