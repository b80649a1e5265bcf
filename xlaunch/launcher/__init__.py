"""The launcher: ``xlaunch [OPTIONS] PROGRAM [ARGS]`` (see :mod:`xlaunch.launcher.cli.command`)."""


def main() -> None:
    """Console-script entry point. A Ctrl-C before the runner took over signals (while the CLI
    is imported, or between that and the CLI's own handling) is exit 130 without a traceback:
    nothing has started yet."""
    try:
        record_early_sigint()
        from xlaunch.launcher.cli.command import main as run_cli

        run_cli()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def record_early_sigint() -> None:
    """Until the runner installs its handlers, a SIGINT still raises KeyboardInterrupt, and is
    also recorded on the handler (``xlaunch_received``), which the runner reads when it takes
    over. Python drops an exception raised inside a weakref callback or a ``__del__`` ("Exception
    ignored in: ..."; seen in importlib's module-lock callback during start-up imports): without
    the record, that Ctrl-C would be lost and the instances started. An inherited ignored SIGINT
    (or a handler the embedding program set) is left alone."""
    import _signal

    if _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:
        return
    received: list = []

    def on_sigint(number: int, _frame: object) -> None:
        received.append(number)
        raise KeyboardInterrupt

    on_sigint.xlaunch_received = received  # type: ignore[attr-defined]
    _signal.signal(_signal.SIGINT, on_sigint)
