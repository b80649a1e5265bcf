"""The output half of a :class:`~.supervisor.Supervisor`: reading the supervised groups' pipes, and the
two sinks (the console for their lines, stderr for xlaunch's messages) that never block the loop.

While the console queue is full the loop stops reading pipes (back-pressure: nothing is lost, instances
wait in their writes) and keeps acting on signals, exits and deadlines; what a write drops (a full disk,
a closed stream) is warned about once and counted at the end, the job itself untouched.
"""
from __future__ import annotations

import errno
import os
import selectors

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Callable, Optional

    from xlaunch.launcher.run.child import Child
    from xlaunch.launcher.run.console import Console
    from xlaunch.launcher.run.logfiles import LogFiles
    from xlaunch.launcher.run.signals import SignalInbox

from xlaunch.launcher.run.signals import JOB_CONTROL, job_control, signal_name

POLL_INTERVAL = 0.2          # upper bound on any wait, in case a wake-up is missed
READ_SIZE = 1 << 16


class OutputSteps:
    """Pipes and sinks; mixed into :class:`~.supervisor.Supervisor`, whose state it uses."""

    children: list[Child]
    console: Console
    messages: Console
    logs: Optional[LogFiles]
    selector: selectors.BaseSelector
    reading: bool
    interrupted: Optional[int]
    _waiting_sinks: set[int]
    _warned: set[str]
    signals: SignalInbox
    log: Callable[[str], None]                   # the Supervisor's messages and loop step
    say: Callable[..., None]
    dispatch: Callable[[selectors.SelectorKey], None]

    def read(self, child: Child) -> None:
        assert child.fd is not None
        try:
            chunk = os.read(child.fd, READ_SIZE)
        except (InterruptedError, BlockingIOError):
            return
        except OSError as error:
            if error.errno != errno.EIO:
                raise
            chunk = b""
        if chunk:
            child.stream.feed(chunk if child.kernels is None else child.kernels.feed(chunk))
        else:
            self.close_pipe(child)

    def close_pipe(self, child: Child) -> None:
        if child.fd is None:
            return
        if child.fd in self.selector.get_map():
            self.selector.unregister(child.fd)
        if child.kernels is not None:     # --kernel-report: the bytes the filter held back
            child.stream.feed(child.kernels.close())
        child.stream.close()
        self.release_pipe(child)
        child.fd = None

    def release_pipe(self, child: Child) -> None:
        """Close the read end of ``child``'s output (subclasses own it differently)."""
        os.close(child.fd)  # type: ignore[arg-type]

    def drain_and_close_pipes(self) -> None:
        """Groups are gone; read what is left in the pipes without waiting, then close them."""
        for child in self.groups():
            while child.fd is not None:
                ready = selectors.DefaultSelector()
                ready.register(child.fd, selectors.EVENT_READ)
                readable = ready.select(0)
                ready.close()
                if not readable:
                    self.close_pipe(child)
                    break
                self.read(child)

    def pipes(self) -> list[Child]:
        return [c for c in self.children if c.fd is not None]

    def update_reading(self) -> None:
        """Stop reading instance pipes while the console queue is full; resume when half empty."""
        if self.reading and self.console.full:
            for child in self.pipes():
                self.selector.unregister(child.fd)
            self.reading = False
            self.log("console not keeping up: output of instances waits in their pipes")
        elif not self.reading and self.console.queued <= self.console.limit // 2:
            for child in self.pipes():
                self.selector.register(child.fd, selectors.EVENT_READ, child)
            self.reading = True

    def watch_pipe(self, child: Child) -> None:
        if self.reading:
            self.selector.register(child.fd, selectors.EVENT_READ, child)  # type: ignore[arg-type]

    def sync_sinks(self) -> float:
        """Wait for writability of sinks with queued lines; return the longest sleep allowed."""
        longest = POLL_INTERVAL
        for sink in (self.console, self.messages):
            fd = sink.fileno() if sink.waits else None
            if fd is not None and fd not in self._waiting_sinks:
                try:
                    self.selector.register(fd, selectors.EVENT_WRITE, sink)
                    self._waiting_sinks.add(fd)
                except (OSError, ValueError, KeyError):   # not pollable here: try again soon
                    longest = 0.05
            elif fd is None:
                for stale in [s for s in self._waiting_sinks if self.selector.get_key(s).data is sink]:
                    self.selector.unregister(stale)
                    self._waiting_sinks.discard(stale)
        return longest

    def check_output(self) -> None:
        """Warn, once each, when console lines or log lines start being dropped."""
        console = self.console
        if console.dropped_lines and "console" not in self._warned:
            self._warned.add("console")
            where = "; the log files keep everything" if self.logs is not None else ""
            self.say(f"console output is being dropped ({console.problem}){where}", warning=True)
        if self.messages.dropped_lines and "messages" not in self._warned:
            self._warned.add("messages")
            self.log(f"stderr does not take xlaunch's messages ({self.messages.problem}): they are only logged here")
        if self.logs is None:
            return
        for index, log in self.logs.instances.items():
            if log.problem is not None and log.path not in self._warned:
                self._warned.add(log.path)
                self.say(f"{self.noun} {index}: cannot write its log {log.path!r} ({log.problem}): the rest of "
                         f"its output is dropped from the log (the console still shows it)", warning=True)
        launcher = self.logs.launcher
        if launcher is not None and launcher.problem is not None and launcher.path not in self._warned:
            self._warned.add(launcher.path)
            self.say(f"cannot write the launcher log {launcher.path!r} ({launcher.problem}): "
                     "later events are not logged", warning=True)

    def report_drops(self) -> None:
        """The end-of-run count of what was dropped (after the summary, before the last flush)."""
        self.check_output()
        if self.console.dropped_lines:
            self.say(f"{self.console.dropped_lines} line(s) of console output dropped ({self.console.problem})",
                     warning=True)
        if self.logs is not None:
            for index, log in self.logs.instances.items():
                if log.problem is not None:
                    self.say(f"{self.noun} {index}: {log.dropped_lines} line(s) missing at the end of its log "
                             f"({log.problem})", warning=True)
        if self.messages.dropped_lines:
            self.log(f"{self.messages.dropped_lines} line(s) of messages could not be written to stderr "
                     f"({self.messages.problem})")

    def finish_output(self) -> None:
        """Write what the sinks still hold: wait for a slow reader, but not once a signal came."""
        sinks = (self.console, self.messages)
        self.handle_late_signals()
        while any(s.waits for s in sinks) and self.interrupted is None:
            self.sync_sinks()
            for key, _events in self.selector.select(POLL_INTERVAL):
                self.dispatch(key)
            self.handle_late_signals()
        self.console.flush()
        if self.console.waits:
            before = self.console.dropped_lines
            self.console.discard("not read before xlaunch exited")
            self.say(f"{self.console.dropped_lines - before} line(s) of console output were not read before "
                     "xlaunch exited: dropped" + (" (the log files have them)" if self.logs is not None else ""),
                     warning=True)
        self.messages.flush()
        if self.messages.waits:
            self.messages.discard("not read before xlaunch exited")
            self.log(f"{self.messages.dropped_lines} line(s) of messages could not be written to stderr")

    def handle_late_signals(self) -> None:
        """Signals after every group is gone stop the final wait for a reader, nothing else."""
        for number in self.signals.take():
            if number in JOB_CONTROL:     # nothing left to stop but xlaunch itself
                job_control(number, [], self.log)
                continue
            if self.interrupted is None:
                self.interrupted = number
            self.log(f"received {signal_name(number)} while writing the last output: not waiting for the reader")
