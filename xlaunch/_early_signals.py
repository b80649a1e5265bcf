"""A Ctrl-C while a command starts (its imports, its option checks) is exit 130, not a traceback.

The console scripts (``xlaunch``, ``xlaunch-tune``) call :func:`record_early_sigint` first thing;
no imports here beyond the interpreter's own ``_signal``.
"""
TYPE_CHECKING = False   # typing stays off the launch path
if TYPE_CHECKING:
    from typing import Callable


def run_console_script(load_main: "Callable[[], Callable[[], object]]") -> None:
    """Record a Ctrl-C (:func:`record_early_sigint`), import the command (``load_main()`` returns its
    main), run it; a Ctrl-C before the command took over signals, or not handled by it, is exit 130
    without a traceback."""
    try:
        received = record_early_sigint()
        command = load_main()
        if received:   # a Ctrl-C during the imports that was only recorded (see record_early_sigint)
            raise KeyboardInterrupt
        command()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def record_early_sigint() -> "list[int] | None":
    """Until the runner installs its handlers, a SIGINT raises KeyboardInterrupt and is recorded on
    the handler (``xlaunch_received``, returned), which the launcher's runner reads when it takes over. Where
    Python would print a raised exception and drop it, inside a ``__del__`` or a weakref callback
    (importlib's module-lock callback during start-up imports, seen in CI), it is only recorded: no
    "Exception ignored" traceback, and the record still stops the launch. An inherited ignored
    SIGINT (or a handler the embedding program set) is left alone: None."""
    import _signal

    if _signal.getsignal(_signal.SIGINT) is not _signal.default_int_handler:
        return None
    received: list = []

    def on_sigint(number: int, frame: object) -> None:
        received.append(number)
        if not raise_would_be_dropped(frame):
            raise KeyboardInterrupt

    on_sigint.xlaunch_received = received  # type: ignore[attr-defined]
    _signal.signal(_signal.SIGINT, on_sigint)
    return received


# Callbacks whose exceptions Python reports as "Exception ignored in ..." and drops: the standard
# library's weakref callbacks, by (file, function); any ``__del__`` besides.
DROPPING_CALLBACKS = frozenset({("<frozen importlib._bootstrap>", "cb")})
DROPPING_CALLBACK_FILES = ("weakref.py", "_weakrefset.py")


def raise_would_be_dropped(frame: object, max_depth: int = 64) -> bool:
    """Whether an exception raised in ``frame`` unwinds into a ``__del__`` or a weakref callback."""
    for _ in range(max_depth):
        if frame is None:
            return False
        code = frame.f_code  # type: ignore[attr-defined]
        if code.co_name == "__del__" or (code.co_filename, code.co_name) in DROPPING_CALLBACKS:
            return True
        if code.co_name in ("remove", "_remove") and code.co_filename.endswith(DROPPING_CALLBACK_FILES):
            return True
        frame = frame.f_back  # type: ignore[attr-defined]
    return False
