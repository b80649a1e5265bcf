"""What every supervising loop of xlaunch shares: messages, signals, process groups, output.

:class:`Supervisor` is the base of the plan runner (:mod:`.runner`, instances it starts itself)
and of the torchrun front (:mod:`.front`, ranks torch's agent starts).
It owns:

* the two output sinks (:mod:`.output`), :class:`~.console.Console` objects for the instances' lines (stdout) and
  xlaunch's own messages (stderr). Neither ever blocks the loop: while the instance-line queue is
  full the loop stops reading instance pipes (back-pressure: nothing is lost, instances wait),
  and keeps acting on signals, exits and deadlines;
* what is dropped because a write failed (a full disk, a closed stream): a warning the first
  time, a count at the end, the job itself untouched;
* the supervised process groups (:class:`~.child.Child`): signals forwarded to every group,
  SIGKILL after the grace period, leftovers of a group whose leader ended stopped the same way
  (Ctrl-Z stops the whole job, :func:`~.signals.job_control`);
* the single-threaded ``select`` loop; subclasses say how groups are reaped and when the run
  is over.
"""
from __future__ import annotations

import os
import selectors
import signal
import sys
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import BinaryIO, Optional, Sequence, TextIO

    from xlaunch.launcher.run.child import Child
    from xlaunch.launcher.run.logfiles import LogFiles

from xlaunch.launcher.run.child import OutputSteps, ended_child
from xlaunch.launcher.run.console import Console
from xlaunch.launcher.run.signals import JOB_CONTROL, SignalInbox, drain_fd, job_control, signal_name

MESSAGES_LIMIT = 1 << 16     # xlaunch's own queued messages: beyond this they are dropped


class Supervisor(OutputSteps):
    """Shared state and steps of a supervising loop (reading pipes and writing sinks: :class:`~.output.OutputSteps`);
    subclasses implement :meth:`reap`."""

    noun = "instance"        # what the supervised groups are called in messages

    def __init__(self, *, grace_period: float, quiet: bool, summary_json: Optional[str] = None,
                 stdout: Optional[BinaryIO] = None, stderr: Optional[TextIO] = None) -> None:
        self.grace = max(0.0, float(grace_period))
        self.quiet = quiet
        self.summary_json = summary_json
        self.console = Console(sys.stdout if stdout is None else stdout)
        self.messages = Console(sys.stderr if stderr is None else stderr, limit=MESSAGES_LIMIT)
        self.logs: Optional[LogFiles] = None
        self.children: list[Child] = []
        self.first_failure: Optional[Child] = None
        self.interrupted: Optional[int] = None         # first signal xlaunch received
        self.signal_counts: dict[int, int] = {}
        self.watchdog = None
        self.selector = selectors.DefaultSelector()
        self.signals = SignalInbox(self.selector, lambda: [c.pgid for c in self.groups() if c.group_alive])
        self.saved_subreaper: Optional[bool] = None
        self.reading = True                             # instance pipes registered for reading
        self._waiting_sinks: set[int] = set()
        self._warned: set[str] = set()

    # ---------------------------------------------------------------- messages

    def log(self, message: str) -> None:
        launcher_log = self.logs.launcher if self.logs is not None else None
        if launcher_log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
            launcher_log.write_text(f"{stamp} {message}\n")

    def say(self, message: str, *, warning: bool = False) -> None:
        """Tell the user (stderr; warnings even when quiet) and the launcher log."""
        self.log(("warning: " if warning else "") + message)
        if warning or not self.quiet:
            self._write_stderr(f"xlaunch: {'warning: ' if warning else ''}{message}\n")

    def plan_messages(self, notes: Sequence[str], warnings: Sequence[str]) -> None:
        """The options' notes and the plan's warnings, unless quiet: printed once the log files are open,
        so that input refused until then gets its one line alone (the launcher log has the plan)."""
        if self.quiet:
            return
        from xlaunch.launcher.plan.show import message_lines

        self._write_stderr(message_lines(notes, warnings))

    def _write_stderr(self, text: str) -> None:
        self.messages.write_lines(text.encode("utf-8", "replace"))

    # ---------------------------------------------------------------- process groups

    def groups(self) -> list[Child]:
        """Every process group under supervision (the front adds its agent to its ranks)."""
        return self.children

    def label(self, child: Child) -> str:
        return f"{self.noun} {child.instance.index}"

    def signal_groups(self, number: int, why: str, *, immediate: bool = False,
                      targets: Optional[list[Child]] = None) -> None:
        """Send ``number`` to every live process group (or those of ``targets``); schedule SIGKILL
        after the grace period."""
        now = time.monotonic()
        for child in self.groups() if targets is None else targets:
            if not child.group_alive:
                continue
            if child.running and not child.stopped_by and not self.ended_on_its_own(child):
                child.stopped_by = why
            self._killpg(child, number)
            if number != signal.SIGKILL:
                self._continue(child)
                deadline = now + self.grace
                child.kill_at = deadline if child.kill_at is None else min(child.kill_at, deadline)
            elif immediate:
                child.kill_at = None

    def ended_on_its_own(self, child: Child) -> bool:
        """``child`` ended, or is ending, before xlaunch signals it (two failing at the same moment): the
        signal does not change how it ended, and its row says nothing of being stopped. Here: xlaunch's
        own child, ended (or every thread exiting) and not reaped yet."""
        return ended_child(child.pid)

    def _killpg(self, child: Child, number: int) -> None:
        try:
            os.killpg(child.pgid, number)
        except (ProcessLookupError, PermissionError):  # gone, or the pgid now belongs to a stranger
            self._group_gone(child)

    def _continue(self, child: Child) -> None:
        """SIGCONT after a signal meant to end ``child``'s group: a process stopped from outside
        (``kill -STOP``) acts on it (a checkpoint handler runs) instead of waiting, stopped, for SIGKILL."""
        if child.group_alive:
            self._killpg(child, signal.SIGCONT)

    def _group_gone(self, child: Child) -> None:
        if child.group_alive and self.watchdog is not None:
            self.watchdog.forget(child.pgid)
        child.group_alive, child.kill_at = False, None

    def enforce_deadlines(self) -> None:
        now = time.monotonic()
        for child in self.groups():
            if child.group_alive and child.kill_at is not None and now >= child.kill_at:
                child.kill_at = None
                self.log(f"{self.label(child)}: grace period over, SIGKILL to group {child.pgid}")
                self._killpg(child, signal.SIGKILL)

    def check_group(self, child: Child) -> None:
        """After its leader ended: stop what is left of the group, note when it is empty."""
        try:
            os.killpg(child.pgid, 0)
        except (ProcessLookupError, PermissionError):
            self._group_gone(child)
            return
        if child.kill_at is None and not child.notes:
            child.notes.append("leftover processes stopped")
            self.log(f"{self.label(child)}: processes left in its group after exit: SIGTERM")
            self._killpg(child, signal.SIGTERM)
            self._continue(child)
            child.kill_at = time.monotonic() + self.grace

    def reap(self) -> None:
        raise NotImplementedError

    def finished(self) -> bool:
        return all(c.done for c in self.groups())

    def start_watchdog(self) -> None:
        from xlaunch.launcher.run.watchdog import Watchdog

        try:
            self.watchdog = Watchdog.start(self.grace, self.registry_fd())
        except OSError as error:
            self.log(f"no watchdog ({error}): if xlaunch is killed, {self.noun}s get SIGTERM only")
            return
        self.log(f"watchdog pid {self.watchdog.pid}")

    def registry_fd(self) -> Optional[int]:
        """A descriptor the watchdog drains for ``+PGID`` lines once xlaunch is gone (the front's)."""
        return None

    def become_subreaper(self) -> None:
        from xlaunch.launcher.run import binding

        try:
            self.saved_subreaper = binding.set_child_subreaper(True)
        except OSError as error:
            self.log(f"cannot become child subreaper ({error}); orphans go to init")

    def restore_subreaper(self) -> None:
        if self.saved_subreaper is not None:
            from xlaunch.launcher.run import binding

            binding.set_child_subreaper(self.saved_subreaper)

    # ---------------------------------------------------------------- signals

    def handle_signals(self) -> None:
        if self.signals.paused:           # stopped by SIGTTOU/SIGTTIN meanwhile: grace periods go on where they were
            self.shift_deadlines(self.signals.paused)
            self.signals.paused = 0.0
        for number in self.signals.take():
            if number in JOB_CONTROL:     # Ctrl-Z stops the whole job, fg/bg continues it
                live = [c.pgid for c in self.groups() if c.group_alive]
                self.shift_deadlines(job_control(number, live, self.log))
                continue
            count = self.signal_counts[number] = self.signal_counts.get(number, 0) + 1
            if self.interrupted is None:
                self.interrupted = number
            name = signal_name(number)
            if count == 1:
                self.say(f"received {name}: forwarding to every {self.noun}, SIGKILL after {self.grace:g}s")
                self.signal_groups(number, f"{name} forwarded")
            else:
                self.say(f"received {name} again: killing every {self.noun} now")
                self.signal_groups(signal.SIGKILL, f"{name} received twice", immediate=True)

    def shift_deadlines(self, paused: float) -> None:
        """The job was stopped for ``paused`` s (Ctrl-Z): grace periods go on where they were."""
        for child in (c for c in self.groups() if c.kill_at is not None):
            child.kill_at += paused

    # ---------------------------------------------------------------- the loop

    def dispatch(self, key: selectors.SelectorKey) -> None:
        data = key.data
        if data is None:
            drain_fd(key.fd)
        elif isinstance(data, Console):
            data.flush()
        elif callable(data):
            data()
        else:
            self.read(data)

    def loop(self) -> None:
        while True:
            self.handle_signals()
            self.reap()
            self.enforce_deadlines()
            if self.finished():
                self.drain_and_close_pipes()
                return
            deadlines = [c.kill_at for c in self.groups() if c.kill_at is not None]
            next_due = self.next_due()
            if next_due is not None:
                deadlines.append(next_due)
            self.update_reading()
            timeout = self.sync_sinks()
            if deadlines:
                timeout = max(0.0, min(timeout, min(deadlines) - time.monotonic()))
            for key, _events in self.selector.select(timeout):
                self.dispatch(key)
            self.check_output()

    def next_due(self) -> Optional[float]:
        """When the loop must wake up for its own reasons (sampling), if ever."""
        return None

    def kill_everything(self) -> None:
        """Last resort (an error in the loop): SIGKILL all groups and reap what we can."""
        for child in (c for c in self.groups() if c.group_alive):
            self._killpg(child, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while any(c.group_alive for c in self.groups()) and time.monotonic() < deadline:
            self.reap()
            for child in self.groups():
                if child.group_alive and child.ended is not None:
                    self._killpg(child, signal.SIGKILL)
            time.sleep(0.01)
        for child in self.groups():
            self.close_pipe(child)

    # ---------------------------------------------------------------- the end

    def exit_status(self) -> int:
        """The first instance's own failure; else 128+N after signal N; else 0.

        An instance that failed only because xlaunch forwarded a signal (even if it then needed
        SIGKILL) does not count as failing on its own: the status is the signal's.
        """
        failure = self.first_failure
        if failure is not None and failure.status and not (self.interrupted is not None and failure.stopped_by):
            return failure.status
        if self.interrupted is not None:
            return 128 + self.interrupted
        return failure.status if failure is not None and failure.status else 0

    def summarize(self, code: int, plan: object, extra: Optional[dict] = None) -> None:
        from xlaunch.launcher.run import reporting

        lines, data = reporting.summary(self.children, plan, code, json=self.summary_json is not None,
                                        noun=self.noun)
        for line in lines:
            self.log("summary: " + line)
        if not self.quiet:
            self._write_stderr("".join(f"xlaunch: {line}\n" for line in lines))
        if data is not None:
            from xlaunch.launcher.observe.summary import write_json

            data.update(extra or {})
            try:
                write_json(self.summary_json, data)
            except OSError as error:
                self.say(f"--summary-json: cannot write {self.summary_json!r}: {error.strerror or error}",
                         warning=True)

    def close(self) -> None:
        self.signals.restore()
        self.selector.close()
        if self.logs is not None:
            self.logs.close()
