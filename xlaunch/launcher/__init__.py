"""The launcher: ``xlaunch [OPTIONS] PROGRAM [ARGS]`` (see :mod:`xlaunch.launcher.cli.command`)."""


def main() -> None:
    """Console-script entry point. A Ctrl-C before the runner took over signals (while the CLI
    is imported, or between that and the CLI's own handling) is exit 130 without a traceback:
    nothing has started yet."""
    try:
        from xlaunch.launcher.cli.command import main as run_cli

        run_cli()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
