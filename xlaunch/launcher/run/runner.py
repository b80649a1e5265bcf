"""The runner: start a :class:`~xlaunch.launcher.plan.planner.Plan`'s instances and supervise them.

The only module of the launcher that touches processes; :func:`run_plan` is the whole API.
Starting one instance is :mod:`.spawning`; log files are :mod:`.logfiles`; the end-of-run table
and JSON are :mod:`.summary`; :mod:`.watchdog` cleans up if xlaunch itself is killed. Here is the
lifecycle (details in ``docs/runner.md``):

* Signal handling is installed first, then instances start one after another. A SIGINT,
  SIGTERM or SIGHUP that arrives while they start is forwarded to those already running and no
  further instance starts. A signal xlaunch inherited as ignored (``nohup``, a background job
  of a script) stays ignored, for xlaunch and its instances alike.
* Supervision is one single-threaded ``select`` loop: pipes, a signal wake-up fd (SIGCHLD,
  SIGINT, SIGTERM, SIGHUP) and deadlines. No threads are ever started, so forking stays safe.
* xlaunch becomes a child subreaper: orphans of an instance stay its children, stay in the
  instance's process group, and are killed and reaped with it (``waitid(P_PGID)``).
"""
from __future__ import annotations

import errno
import os
import selectors
import signal
import sys
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import BinaryIO, Optional, TextIO

from xlaunch.launcher.run import reporting, spawning
from xlaunch.launcher.run.child import Child, status_code, status_text
from xlaunch.launcher.plan.planner import Plan
from xlaunch.launcher.run.console import Console, InstanceStream
from xlaunch.launcher.run.signals import SignalInbox, drain_fd, signal_name

POLL_INTERVAL = 0.2          # upper bound on any wait, in case a wake-up is missed
READ_SIZE = 1 << 16


class _Supervisor:
    """Runs one plan to completion. Construct, call :meth:`run` once."""

    def __init__(self, plan: Plan, *, log_dir: Optional[str], log_file_prefix: str, keep_going: bool,
                 grace_period: float, quiet: bool, summary_json: Optional[str] = None,
                 stdout: Optional[BinaryIO] = None, stderr: Optional[TextIO] = None) -> None:
        self.plan = plan
        self.keep_going = keep_going
        self.grace = max(0.0, float(grace_period))
        self.quiet = quiet
        self.summary_json = summary_json
        self.stderr = stderr if stderr is not None else sys.stderr
        self.console = Console(stdout)
        self.log_dir = log_dir
        self.prefix = log_file_prefix
        self.logs = None                               # logfiles.LogFiles when log_dir is set
        self.children: list[Child] = []
        self.first_failure: Optional[Child] = None
        self.interrupted: Optional[int] = None         # first signal xlaunch received
        self.signal_counts: dict[int, int] = {}
        self.memory = spawning.MemoryPolicy()
        self.watchdog = None
        self.selector = selectors.DefaultSelector()
        self.signals = SignalInbox(self.selector)
        self.saved_subreaper: Optional[bool] = None

    # ---------------------------------------------------------------- messages

    def log(self, message: str) -> None:
        launcher_log = self.logs.launcher if self.logs is not None else None
        if launcher_log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
            launcher_log.write(f"{stamp} {message}\n")
            launcher_log.flush()

    def say(self, message: str, *, warning: bool = False) -> None:
        """Tell the user (stderr; warnings even when quiet) and the launcher log."""
        self.log(("warning: " if warning else "") + message)
        if warning or not self.quiet:
            self._write_stderr(f"xlaunch: {'warning: ' if warning else ''}{message}\n")

    def _write_stderr(self, text: str) -> None:
        try:
            self.stderr.write(text)
            self.stderr.flush()
        except (BrokenPipeError, ValueError):
            pass

    def open_logs(self) -> None:
        if self.log_dir is not None:
            from xlaunch.launcher.run.logfiles import open_log_files

            self.logs = open_log_files(self.log_dir, self.prefix, [i.index for i in self.plan.instances], self.plan.kernel_report)
        for instance in self.plan.instances:
            log = self.logs.instances[instance.index] if self.logs is not None else None
            kernels = reporting.kernel_filter(self.logs, instance.index) if self.plan.kernel_report else None
            self.children.append(Child(instance, InstanceStream(instance.index, self.console, log), kernels=kernels))
        if self.logs is not None and self.logs.kept:
            self.say(f"earlier logs kept as {', '.join(os.path.basename(p) for p in self.logs.kept[:2])}"
                     + (f" and {len(self.logs.kept) - 2} more" if len(self.logs.kept) > 2 else ""))

    def log_plan(self) -> None:
        for line in reporting.plan_lines(self.plan, keep_going=self.keep_going, grace=self.grace):
            self.log(line)

    def start_line(self) -> None:
        count = len(self.plan.instances)
        cpus = sum(len(i.cpus) for i in self.plan.instances)
        self.say(f"starting {count} instance{'s' if count != 1 else ''} on {cpus} CPU{'s' if cpus != 1 else ''}: "
                 f"allocator {self.plan.allocator}, OpenMP {self.plan.openmp}")

    # ---------------------------------------------------------------- signals

    def handle_signals(self) -> None:
        for number in self.signals.take():
            count = self.signal_counts[number] = self.signal_counts.get(number, 0) + 1
            if self.interrupted is None:
                self.interrupted = number
            name = signal_name(number)
            if count == 1:
                self.say(f"received {name}: forwarding to every instance, SIGKILL after {self.grace:g}s")
                self.signal_groups(number, f"{name} forwarded")
            else:
                self.say(f"received {name} again: killing every instance now")
                self.signal_groups(signal.SIGKILL, f"{name} received twice", immediate=True)

    # ---------------------------------------------------------------- processes

    def start_watchdog(self, single_threaded: bool) -> None:
        if not single_threaded:
            self.log("the launcher has other threads: no watchdog (forking is unsafe)")
            return
        from xlaunch.launcher.run.watchdog import Watchdog

        try:
            self.watchdog = Watchdog.start(self.grace)
        except OSError as error:
            self.log(f"no watchdog ({error}): if xlaunch is killed, instances get SIGTERM only")
            return
        self.log(f"watchdog pid {self.watchdog.pid}")

    def spawn_all(self, single_threaded: bool) -> None:
        stdin = spawning.stdin_for(len(self.children))
        if not single_threaded:
            self.log("the launcher has other threads: PR_SET_PDEATHSIG skipped (preexec is unsafe)")
        for child in self.children:
            self.handle_signals()
            if self.interrupted is not None:
                child.text = f"not started ({signal_name(self.interrupted)} received)"
            elif self.first_failure is not None and not self.keep_going:
                child.text = "not started (an earlier instance failed)"
            else:
                self.spawn(child, stdin, single_threaded)
        self.handle_signals()

    def spawn(self, child: Child, stdin: Optional[int], single_threaded: bool) -> None:
        instance = child.instance
        child.started = time.monotonic()
        refused_before = self.memory.refused
        try:
            child.proc = spawning.spawn(instance, stdin=stdin, die_with_parent=single_threaded, memory=self.memory)
        except OSError as error:
            child.status, message = spawning.start_failure(error, instance)
            child.ended = time.monotonic()
            child.text = f"not started ({error.strerror or error})"
            self.say(f"instance {instance.index} could not start: {message}", warning=True)
            self.record_failure(child)
            return
        finally:
            if self.memory.refused is not None and refused_before is None:
                refused = self.memory.refused
                self.say(f"memory policy refused ({refused.strerror or refused}): instances are bound to "
                         f"their CPUs only", warning=True)
        if self.watchdog is not None:
            self.watchdog.watch(child.pid)
        child.group_alive = True
        child.text = "running"
        assert child.proc.stdout is not None
        child.fd = child.proc.stdout.fileno()
        self.selector.register(child.fd, selectors.EVENT_READ, child)
        self.log(f"instance {instance.index} started: pid {child.pid}")

    def signal_groups(self, number: int, why: str, *, immediate: bool = False) -> None:
        """Send ``number`` to every live process group; schedule SIGKILL after the grace period."""
        now = time.monotonic()
        for child in self.children:
            if not child.group_alive:
                continue
            if child.running and not child.stopped_by:
                child.stopped_by = why
            self._killpg(child, number)
            if number != signal.SIGKILL:
                deadline = now + self.grace
                child.kill_at = deadline if child.kill_at is None else min(child.kill_at, deadline)
            elif immediate:
                child.kill_at = None

    def _killpg(self, child: Child, number: int) -> None:
        try:
            os.killpg(child.pid, number)
        except (ProcessLookupError, PermissionError):  # gone, or the pgid now belongs to a stranger
            self._group_gone(child)

    def _group_gone(self, child: Child) -> None:
        if child.group_alive and self.watchdog is not None:
            self.watchdog.forget(child.pid)
        child.group_alive = False
        child.kill_at = None

    def enforce_deadlines(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.group_alive and child.kill_at is not None and now >= child.kill_at:
                child.kill_at = None
                self.log(f"instance {child.instance.index}: grace period over, SIGKILL to group {child.pid}")
                self._killpg(child, signal.SIGKILL)

    def reap(self) -> None:
        """Collect every exited process of every instance group (leaders and adopted orphans)."""
        for child in self.children:
            if child.proc is None or not child.group_alive:
                continue
            while True:
                try:
                    result = os.waitid(os.P_PGID, child.pid, os.WEXITED | os.WNOHANG)
                except ChildProcessError:
                    result = None
                    break
                except InterruptedError:
                    continue
                if result is None or result.si_pid == 0:
                    break
                if result.si_pid == child.pid:
                    self.leader_ended(child, result.si_code, result.si_status)
            if child.ended is not None:
                self._check_group(child)

    def _check_group(self, child: Child) -> None:
        """After its leader ended: stop what is left of the group, note when it is empty."""
        try:
            os.killpg(child.pid, 0)
        except (ProcessLookupError, PermissionError):
            self._group_gone(child)
            return
        if child.kill_at is None and not child.notes:
            child.notes.append("leftover processes stopped")
            self.log(f"instance {child.instance.index}: processes left in its group after exit: SIGTERM")
            self._killpg(child, signal.SIGTERM)
            child.kill_at = time.monotonic() + self.grace

    def leader_ended(self, child: Child, wait_code: int, value: int) -> None:
        child.ended = time.monotonic()
        child.status = status_code(wait_code, value)
        child.text = status_text(wait_code, value)
        if child.proc is not None:
            child.proc.returncode = child.status  # reaped here; Popen must not wait again
        self.log(f"instance {child.instance.index} (pid {child.pid}) ended: {child.text} "
                 f"after {child.ended - child.started:.3f}s"
                 + (f" ({child.stopped_by})" if child.stopped_by else ""))
        if child.status != 0:
            self.record_failure(child)

    def record_failure(self, child: Child) -> None:
        if self.first_failure is not None:
            return
        self.first_failure = child
        if self.keep_going or child.stopped_by:
            return
        others = [c for c in self.children if c is not child and c.running]
        if others:
            self.say(f"instance {child.instance.index} failed ({child.text}): stopping the others "
                     f"(SIGTERM, SIGKILL after {self.grace:g}s)")
            self.signal_groups(signal.SIGTERM, f"stopped after instance {child.instance.index} failed")

    # ---------------------------------------------------------------- output

    def read(self, child: Child) -> None:
        assert child.fd is not None
        try:
            chunk = os.read(child.fd, READ_SIZE)
        except InterruptedError:
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
        self.selector.unregister(child.fd)
        if child.kernels is not None:     # --kernel-report: the bytes the filter held back
            child.stream.feed(child.kernels.close())
        child.stream.close()
        if child.proc is not None and child.proc.stdout is not None:
            child.proc.stdout.close()
        child.fd = None

    def drain_and_close_pipes(self) -> None:
        """Groups are gone; read what is left in the pipes without waiting, then close them."""
        for child in self.children:
            while child.fd is not None:
                ready = selectors.DefaultSelector()
                ready.register(child.fd, selectors.EVENT_READ)
                readable = ready.select(0)
                ready.close()
                if not readable:
                    self.close_pipe(child)
                    break
                self.read(child)

    # ---------------------------------------------------------------- observation

    def observe(self) -> Optional[float]:
        """Sample running instances; return when the next sample is due (:mod:`.reporting`)."""
        return reporting.observe(self.children, time.monotonic())

    # ---------------------------------------------------------------- the loop

    def loop(self) -> None:
        while True:
            self.handle_signals()
            self.reap()
            self.enforce_deadlines()
            if all(c.done for c in self.children):
                self.drain_and_close_pipes()
                return
            deadlines = [c.kill_at for c in self.children if c.kill_at is not None]
            next_sample = self.observe()
            if next_sample is not None:
                deadlines.append(next_sample)
            timeout = POLL_INTERVAL
            if deadlines:
                timeout = max(0.0, min(timeout, min(deadlines) - time.monotonic()))
            for key, _events in self.selector.select(timeout):
                if key.data is None:
                    drain_fd(key.fd)
                else:
                    self.read(key.data)

    def kill_everything(self) -> None:
        """Last resort (an error in the loop): SIGKILL all groups and reap what we can."""
        for child in self.children:
            if child.group_alive:
                self._killpg(child, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while any(c.group_alive for c in self.children) and time.monotonic() < deadline:
            self.reap()
            for child in self.children:
                if child.group_alive and child.ended is not None:
                    self._killpg(child, signal.SIGKILL)
            time.sleep(0.01)
        for child in self.children:
            self.close_pipe(child)

    def run(self) -> int:
        try:
            self.open_logs()          # an OptionError here: nothing started, nothing left behind
            self.log_plan()
            self.start_line()
            self.signals.install(self.log)
            single_threaded = spawning.single_threaded()
            try:
                from xlaunch.launcher.run import binding

                self.saved_subreaper = binding.set_child_subreaper(True)
            except OSError as error:
                self.log(f"cannot become child subreaper ({error}); orphans go to init")
            try:
                self.start_watchdog(single_threaded)
                self.spawn_all(single_threaded)
                self.loop()
            except BaseException:
                self.kill_everything()
                raise
            finally:
                if self.watchdog is not None:
                    self.watchdog.stop()
                if self.saved_subreaper is not None:
                    from xlaunch.launcher.run import binding

                    binding.set_child_subreaper(self.saved_subreaper)
                self.signals.restore()
            code = self.exit_status()
            for warning in reporting.observation_warnings(self.children, self.plan):
                self.say(warning, warning=True)
            self.summarize(code)
            return code
        finally:
            self.selector.close()
            if self.logs is not None:
                self.logs.close()

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

    def summarize(self, code: int) -> None:
        lines, data = reporting.summary(self.children, self.plan, code, json=self.summary_json is not None)
        for line in lines:
            self.log("summary: " + line)
        if not self.quiet:
            self._write_stderr("".join(f"xlaunch: {line}\n" for line in lines))
        if data is not None:
            from xlaunch.launcher.observe.summary import write_json

            try:
                write_json(self.summary_json, data)
            except OSError as error:
                self.say(f"--summary-json: cannot write {self.summary_json!r}: {error.strerror or error}",
                         warning=True)


def run_plan(plan: Plan, *, log_dir: Optional[str] = None, log_file_prefix: str = "xlaunch",
             keep_going: bool = False, grace_period: float = 5.0, quiet: bool = False,
             summary_json: Optional[str] = None) -> int:
    """Start every instance of ``plan``, supervise them, return the shell-style exit status.

    * Output: each instance's stdout and stderr (merged, in the order written) go to the console
      as whole lines prefixed ``[i] ``; with ``log_dir``, also unprefixed to
      ``<log_dir>/<log_file_prefix>_instance_<i>.log``, and the launcher's own events to
      ``<log_dir>/<log_file_prefix>_launcher.log`` (see :mod:`.logfiles`; a log file that cannot
      be created raises :class:`~xlaunch.launcher.errors.OptionError` before anything starts).
    * Fail-fast (default): the first instance to fail (non-zero exit or a signal) makes xlaunch
      stop the others (SIGTERM to their process groups, SIGKILL after ``grace_period`` s) and its
      status is returned (exit code, or 128+N for signal N). ``keep_going``: all run to the end;
      the first failure's status is returned.
    * SIGINT/SIGTERM/SIGHUP received by xlaunch are forwarded to every instance's process group
      (SIGKILL after ``grace_period``; a second identical signal kills at once); instances not
      started yet are not started. Unless an instance failed on its own first, the status is
      128+N of the received signal.
    * If xlaunch is killed outright, the watchdog stops every instance group (SIGTERM, SIGKILL
      after ``grace_period``).
    * Unless ``quiet``, a start line and a summary per instance go to stderr; ``summary_json``
      names a file for the summary as JSON.
    """
    return _Supervisor(plan, log_dir=log_dir, log_file_prefix=log_file_prefix, keep_going=keep_going,
                       grace_period=grace_period, quiet=quiet, summary_json=summary_json).run()
