"""The signals xlaunch forwards (SIGINT, SIGTERM, SIGHUP) and job control (SIGTSTP, SIGCONT; SIGTTOU and
SIGTTIN, acted on in their handler), caught into a queue the runner's ``select`` loop empties; SIGCHLD and those signals wake the loop
through a pipe (``signal.set_wakeup_fd``). A signal inherited as ignored (``nohup``, a background
job) stays ignored. Only from the main thread: elsewhere the runner polls for exits instead."""
from __future__ import annotations

import os
import selectors
import signal
import threading
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Callable, Optional

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
JOB_CONTROL = (signal.SIGTSTP, signal.SIGCONT)    # Ctrl-Z, fg/bg: see job_control()
# a background xlaunch wrote to (``stty tostop``) or read from its terminal: acted on in the handler itself,
# since the write the kernel refused is retried as soon as the handler returns (see SignalInbox._on_tty_stop)
TTY_STOPS = (signal.SIGTTIN, signal.SIGTTOU)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class SignalInbox:
    """Handlers for :data:`FORWARDED_SIGNALS` that queue what arrives; :meth:`take` empties it.
    :data:`TTY_STOPS` stop the job at once (the groups ``live_groups()`` names, then xlaunch); the time
    stopped accumulates in :attr:`paused` for the loop's deadlines."""

    def __init__(self, selector: selectors.BaseSelector,
                 live_groups: Optional[Callable[[], list[int]]] = None) -> None:
        self.selector = selector
        self.live_groups = live_groups
        self.paused = 0.0
        self.ending = False        # a forwarded signal came: the job is ending
        self.log: Callable[[str], None] = _no_log
        self.pending: list[int] = []
        self.wakeup_r: Optional[int] = None
        self.wakeup_w: Optional[int] = None
        self.saved_handlers: dict[int, object] = {}
        self.saved_wakeup_fd: Optional[int] = None

    def install(self, log: Callable[[str], None]) -> None:
        if threading.current_thread() is not threading.main_thread():
            log("not in the main thread: no signal forwarding, polling for exits")
            return
        self.wakeup_r, self.wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.saved_wakeup_fd = signal.set_wakeup_fd(self.wakeup_w, warn_on_full_buffer=False)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, None)
        self.log = log
        for number in FORWARDED_SIGNALS + JOB_CONTROL + TTY_STOPS:
            if signal.getsignal(number) is signal.SIG_IGN:
                # ignored since start (nohup, a shell's background job): stays ignored, as it
                # was before this point and is for the instances, which inherit the ignore
                log(f"{signal_name(number)} is ignored (inherited): not forwarded")
                continue
            previous = signal.signal(number, self._on_tty_stop if number in TTY_STOPS else self._on_signal)
            self.saved_handlers[number] = previous
            # a Ctrl-C whose KeyboardInterrupt Python dropped during start-up (xlaunch.launcher's
            # record_early_sigint): acted on now, before any instance starts
            early = getattr(previous, "xlaunch_received", None)
            if early:
                self.pending.extend(early)
                early.clear()
        self.saved_handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, _wake_only)

    def restore(self) -> None:
        for number, handler in self.saved_handlers.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        if self.wakeup_w is not None:
            signal.set_wakeup_fd(self.saved_wakeup_fd if self.saved_wakeup_fd is not None else -1)
            self.selector.unregister(self.wakeup_r)
            os.close(self.wakeup_r)  # type: ignore[arg-type]
            os.close(self.wakeup_w)
            self.wakeup_r = self.wakeup_w = None

    def take(self) -> list[int]:
        """The signals received since the last call, in order."""
        taken, self.pending = self.pending, []
        return taken

    def _on_signal(self, number: int, _frame: object) -> None:
        self.pending.append(number)
        if number in FORWARDED_SIGNALS:
            self.ending = True

    def _on_tty_stop(self, number: int, _frame: object) -> None:
        """SIGTTOU/SIGTTIN: stop the job now. Queued like the others, the refused write would be retried
        (PEP 475) before the loop saw the signal, and the kernel would answer with SIGTTOU again, forever.
        Once a signal to end the job came (``kill %1`` of the stopped job: SIGTERM, then SIGCONT), the
        terminal is written from the background: stopping again would leave the job stopped for good."""
        if self.ending:
            signal.signal(number, signal.SIG_IGN)     # the kernel then lets the write through
            self.log(f"received {signal_name(number)} while the job ends: writing to the terminal anyway")
            return
        pgids = self.live_groups() if self.live_groups is not None else []
        self.paused += job_control(number, pgids, self.log)


def job_control(number: int, pgids: list[int], log: Callable[[str], None]) -> float:
    """SIGTSTP (Ctrl-Z), SIGTTOU/SIGTTIN (a background xlaunch that wrote to the terminal under ``stty
    tostop``, or read it): SIGSTOP to every process group in ``pgids``, then xlaunch stops itself with the
    same signal (the default action: the shell says why, ``Stopped (tty output)``), and the groups get
    SIGCONT when it continues (``fg``, ``bg``); SIGCONT alone (xlaunch stopped with SIGSTOP) continues
    them. Instances sit in sessions of their own, so the terminal's signals never reach them, and a
    SIGTSTP sent to them would be discarded (their process groups are orphaned): SIGSTOP is what stops
    them. Returns the seconds xlaunch was stopped."""
    paused = 0.0
    if number != signal.SIGCONT:
        log(f"received {signal_name(number)}: SIGSTOP to {len(pgids)} process group(s), then xlaunch stops")
        _signal_all(pgids, signal.SIGSTOP)
        handler = signal.signal(number, signal.SIG_DFL)
        before = time.monotonic()
        try:   # stops here until SIGCONT (at once back in an orphaned process group, which cannot stop)
            os.kill(os.getpid(), number)
        finally:
            signal.signal(number, handler)
        paused = time.monotonic() - before
    log(f"continued{f' after {paused:.1f}s' if paused else ''}: SIGCONT to {len(pgids)} process group(s)")
    _signal_all(pgids, signal.SIGCONT)
    return paused


def _signal_all(pgids: list[int], number: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, number)
        except (ProcessLookupError, PermissionError):   # gone; the supervisor finds out on its own
            pass


def _no_log(_message: str) -> None:
    pass


def _wake_only(_number: int, _frame: object) -> None:
    """SIGCHLD only needs to wake the select loop (through the wake-up fd)."""


def drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass
