"""The launcher: ``xlaunch [OPTIONS] PROGRAM [ARGS]`` (see :mod:`xlaunch.launcher.cli`)."""


def main() -> None:
    """Console-script entry point. A Ctrl-C while the CLI is still being imported is exit 130
    without a traceback: nothing has started yet."""
    try:
        from xlaunch.launcher.cli import main as run_cli
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    run_cli()
