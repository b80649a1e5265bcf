"""The launcher's surface for other tools (``xlaunch-tune``): what they may use, in one place.

Tools stay off the launcher's rooms (an import-linter contract checks it): they validate options
as the launcher does, read config files with its errors, list its command-line options and run
its command line in-process. Anything else they need belongs here first.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from xlaunch.launcher.errors import USAGE_EXIT_STATUS, LaunchInputError, OptionError
from xlaunch.launcher.plan.options import (
    SETTABLE,
    Options,
    build_options,
    canonical_name,
    flag_name,
    load_config_option,
    option_fields,
    strict_float,
    strict_int,
)

__all__ = [
    "USAGE_EXIT_STATUS", "LaunchInputError", "OptionError", "SETTABLE", "Options", "build_options",
    "canonical_name", "flag_name", "load_config_option", "option_fields", "strict_int", "strict_float", "click_options",
    "run_command_line", "kernel_cell", "prepare_standard_streams",
]


def click_options() -> list[Any]:
    """The launcher's click options (for a tool's ``--help`` and to accept them as fixed options)."""
    import click

    from xlaunch.launcher.cli.click_command import command

    return [p for p in command.params if isinstance(p, click.Option)]


def run_command_line(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> int:
    """``xlaunch ARGV`` in this process (``--dry-run`` checks a configuration); the exit status."""
    from xlaunch.launcher.cli.command import run

    return run(list(argv), environ=None if environ is None else dict(environ))


def kernel_cell(kernels: Optional[Mapping[str, Any]]) -> str:
    """A few words on what oneDNN ran (``AVX2, conv avx2 f32, w 1.0/call``) from an instance's
    ``observed.kernels`` in ``--summary-json``; ``-`` when there is none."""
    from xlaunch.launcher.observe.kernel_report import kernel_cell as cell

    return cell(dict(kernels) if kernels else None)


def prepare_standard_streams() -> None:
    """As the launcher starts: closed descriptors 0-2 on /dev/null, a ``sys.stderr`` that drops what its
    descriptor refuses (full, closed, read by nobody) instead of raising."""
    from xlaunch.launcher.cli.streams import prepare_standard_streams as prepare

    prepare()
