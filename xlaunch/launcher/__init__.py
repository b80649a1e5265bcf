"""The launcher: ``xlaunch [OPTIONS] PROGRAM [ARGS]`` (see :mod:`xlaunch.launcher.cli.command`)."""
from xlaunch._early_signals import raise_would_be_dropped, record_early_sigint, run_console_script

TYPE_CHECKING = False   # typing stays off the launch path
if TYPE_CHECKING:
    from typing import Callable

__all__ = ["main", "raise_would_be_dropped", "record_early_sigint"]


def main() -> None:
    """Console-script entry point. A Ctrl-C before the runner took over signals (while the CLI
    is imported, or between that and the CLI's own handling) is exit 130 without a traceback:
    nothing has started yet."""
    def load() -> "Callable[[], object]":
        from xlaunch.launcher.cli.command import main as run_cli

        return run_cli

    run_console_script(load)
