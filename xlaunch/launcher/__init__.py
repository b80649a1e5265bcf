"""The launcher: ``xlaunch [OPTIONS] PROGRAM [ARGS]`` (see :mod:`xlaunch.launcher.cli.command`)."""
from xlaunch._early_signals import raise_would_be_dropped, record_early_sigint

__all__ = ["main", "raise_would_be_dropped", "record_early_sigint"]


def main() -> None:
    """Console-script entry point. A Ctrl-C before the runner took over signals (while the CLI
    is imported, or between that and the CLI's own handling) is exit 130 without a traceback:
    nothing has started yet."""
    try:
        received = record_early_sigint()
        from xlaunch.launcher.cli.command import main as run_cli

        if received:   # a Ctrl-C during the imports that was not raised (see record_early_sigint)
            raise KeyboardInterrupt
        run_cli()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
