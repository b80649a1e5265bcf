"""The runner: start a :class:`~xlaunch.launcher.plan.planner.Plan`'s instances and supervise them.

The only module of the launcher that starts instances; :func:`run_plan` is the whole API.
Starting one instance is :mod:`.spawning`; log files are :mod:`.logfiles`; the end-of-run table
and JSON are :mod:`.reporting`; :mod:`.watchdog` cleans up if xlaunch itself is killed; the loop,
signals, groups and output sinks it shares with the torchrun front are :mod:`.supervisor`. Here is
the lifecycle (details in ``docs/runner.md``):

* Signal handling is installed first, then instances start one after another. A SIGINT,
  SIGTERM or SIGHUP that arrives while they start is forwarded to those already running and no
  further instance starts. A signal xlaunch inherited as ignored (``nohup``, a background job
  of a script) stays ignored, for xlaunch and its instances alike.
* Supervision is one single-threaded ``select`` loop: pipes, a signal wake-up fd (SIGCHLD,
  SIGINT, SIGTERM, SIGHUP), the console when it cannot take more yet, and deadlines. No threads
  are ever started, so forking stays safe, and no write ever blocks the loop.
* xlaunch becomes a child subreaper: orphans of an instance stay its children, stay in the
  instance's process group, and are killed and reaped with it (``waitid(P_PGID)``).
"""
from __future__ import annotations

import os
import signal
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import BinaryIO, Optional, Sequence, TextIO

    from xlaunch.launcher.plan.records import Instance
    from xlaunch.launcher.run.shared_imports.client import ForkServer

from xlaunch.launcher.run import reporting, spawning
from xlaunch.launcher.run.child import Child, remove_openmp_registration, status_code, status_text
from xlaunch.launcher.plan.records import Plan
from xlaunch.launcher.run.console import InstanceStream
from xlaunch.launcher.run.signals import signal_name
from xlaunch.launcher.run.strays import Strays
from xlaunch.launcher.run.supervisor import Supervisor


class _PlanRunner(Supervisor):
    """Runs one plan to completion. Construct, call :meth:`run` once."""

    def __init__(self, plan: Plan, *, log_dir: Optional[str], log_file_prefix: str, keep_going: bool,
                 grace_period: float, quiet: bool, summary_json: Optional[str] = None,
                 notes: Sequence[str] = (), stdout: Optional[BinaryIO] = None,
                 stderr: Optional[TextIO] = None) -> None:
        super().__init__(grace_period=grace_period, quiet=quiet, summary_json=summary_json,
                         stdout=stdout, stderr=stderr)
        self.plan = plan
        self.keep_going = keep_going
        self.log_dir = log_dir
        self.prefix = log_file_prefix
        self.notes = tuple(notes)
        self.memory = spawning.MemoryPolicy()
        self.records: Optional[str] = None   # --auto-optimize: the folder of the instances' engine records
        self.servers: dict[int, Optional[ForkServer]] = {}   # --share-imports: position in plan.import_servers
        self.served: list[dict] = []          # --share-imports: what each server did, for --summary-json
        self.strays = Strays(False)           # processes that left their instance's group (run() enables it)

    # ---------------------------------------------------------------- messages

    def open_logs(self) -> None:
        if self.log_dir is not None:
            from xlaunch.launcher.run.logfiles import open_log_files

            total = _plan_size(self.plan)
            self.logs = open_log_files(self.log_dir, self.prefix, [i.index for i in self.plan.instances], total=total,
                                       onednn=self.plan.kernel_report)
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
        shared = self.plan.import_servers[0].modules if self.plan.import_servers else ()   # every server's alike
        servers = len(self.plan.import_servers)
        self.say(f"starting {count} instance{'s' if count != 1 else ''} on {cpus} CPU{'s' if cpus != 1 else ''}: "
                 f"allocator {self.plan.allocator}, OpenMP {self.plan.openmp}"
                 + (f", forked from {servers} process{'es' if servers != 1 else ''} that imported {','.join(shared)}"
                    if shared else ""))

    # ---------------------------------------------------------------- processes

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
            started = reporting.with_engine_record(self, child)
            server = self.fork_server(instance) if self.plan.import_servers else None
            if self.interrupted is not None:     # it came while the fork server imported
                child.text = f"not started ({signal_name(self.interrupted)} received)"
                return
            if server is not None:
                child.started = time.monotonic()   # its own start, not the server's imports
                child.proc = server.spawn(started, stdin, self.memory)
            else:
                child.proc = spawning.spawn(started, stdin=stdin, die_with_parent=single_threaded, memory=self.memory)
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
        self.watch_pipe(child)
        self.log(f"instance {instance.index} started: pid {child.pid}")

    def fork_server(self, instance: Instance) -> Optional[ForkServer]:
        """``--share-imports``: the ready fork server of ``instance`` (:meth:`launch_servers` started it), or
        None when it cannot serve (said once; its instances then start on their own)."""
        from xlaunch.launcher.plan.shared import server_of
        from xlaunch.launcher.run.shared_imports.client import ServerUnavailable

        position = server_of(self.plan.import_servers, instance.index)
        server = self.servers.get(position)
        if server is not None and not server.ready:
            try:
                server.wait_ready(self._interrupted)
            except ServerUnavailable as error:
                self.servers[position] = server = None
                self.unavailable(position, str(error))
            else:
                self.served.append({"modules": list(server.spec.modules), "instances": list(server.spec.indices),
                                    "pid": server.proc.pid, "import_s": server.seconds})
                self.log(f"shared imports: {','.join(server.spec.modules)} imported in {server.seconds:.2f}s "
                         f"(pid {server.proc.pid})")
                self.show_server_output(server)
        return server

    def show_server_output(self, server: ForkServer) -> None:
        """What a ready server printed so far (its imports' messages, which each instance would have printed
        without ``--share-imports``): on the console once, each line prefixed ``[imports 0-3] `` (the
        instances it serves), and in the launcher log."""
        from xlaunch.cpulist import format_cpulist

        data, left_out = server.unshown_output()
        if not data and not left_out:
            return
        label = f"imports {format_cpulist(server.spec.indices)}"
        stream = InstanceStream(-1, self.console, label=label)
        stream.feed(data)
        if left_out:
            stream.feed(f"\n(xlaunch: {left_out} more bytes of this output not shown)\n".encode())
        stream.close()
        for line in data.decode(errors="replace").splitlines():
            self.log(f"shared imports printed: {line}")

    def launch_servers(self, single_threaded: bool) -> None:
        """``--share-imports``: start every fork server now, so that they import at once."""
        from xlaunch.launcher.run.shared_imports.client import ForkServer, ServerUnavailable

        by_index = {instance.index: instance for instance in self.plan.instances}
        for position, spec in enumerate(self.plan.import_servers):
            self.servers[position] = None
            if self.saved_subreaper is None:
                self.unavailable(position, "xlaunch cannot adopt forked instances here (no child subreaper)")
                continue
            try:
                self.servers[position] = ForkServer.launch(spec, by_index[spec.indices[0]],
                                                           die_with_parent=single_threaded, memory=self.memory)
            except ServerUnavailable as error:
                self.unavailable(position, str(error))

    def unavailable(self, position: int, why: str) -> None:
        """Server ``position`` cannot serve: recorded for the summary, said once (not when a signal stopped it)."""
        spec = self.plan.import_servers[position]
        self.served.append({"modules": list(spec.modules), "instances": list(spec.indices), "unavailable": why})
        if self.interrupted is None:
            self.say(f"--share-imports: {why}; instances {','.join(map(str, spec.indices))} start on their own",
                     warning=True)

    def _interrupted(self) -> bool:
        self.handle_signals()
        return self.interrupted is not None

    def close_servers(self, *, kill: bool = False) -> None:
        for server in self.servers.values():
            if server is not None:
                server.close(kill=kill, grace=self.grace)
                if server.ready:              # anything it printed after it was ready (at its exit)
                    self.show_server_output(server)
        self.servers = {position: None for position in self.servers}

    def release_pipe(self, child: Child) -> None:
        if child.proc is not None and child.proc.stdout is not None:
            child.proc.stdout.close()

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
                if result.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                    remove_openmp_registration(result.si_pid)     # its OpenMP never ran its exit
                if result.si_pid == child.pid:
                    self.leader_ended(child, result.si_code, result.si_status)
            if child.ended is not None:
                self.check_group(child)
        self.strays.reap_ended((c.pgid for c in self.children if c.proc is not None),
                               [self.watchdog.pid] if self.watchdog is not None else [], self.watchdog)

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

    def next_due(self) -> Optional[float]:
        """Sample running instances; return when the next sample is due (:mod:`.reporting`)."""
        return reporting.observe(self.children, time.monotonic())

    # ---------------------------------------------------------------- the run

    def run(self) -> int:
        try:
            self.open_logs()          # an OptionError here: nothing started, nothing left behind
            self.log_plan()
            self.plan_messages(self.notes, self.plan.warnings)
            self.start_line()
            self.signals.install(self.log)
            single_threaded = spawning.single_threaded()
            self.become_subreaper()
            self.strays = Strays(single_threaded and self.saved_subreaper is not None)
            try:
                self.start_watchdog()
                if self.plan.import_servers:
                    self.launch_servers(single_threaded)
                self.spawn_all(single_threaded)
                self.close_servers()
                self.loop()
                self.strays.stop([self.watchdog.pid] if self.watchdog is not None else [], self.grace, self.say,
                                 self.noun)
            except BaseException:
                self.close_servers(kill=True)
                self.kill_everything()
                raise
            finally:
                if self.watchdog is not None:
                    self.watchdog.stop()
                self.restore_subreaper()
            code = self.exit_status()
            for warning in reporting.observation_warnings(self.children, self.plan):
                self.say(warning, warning=True)
            self.summarize(code, self.plan, {"import_servers": self.served} if self.served else None)
            self.report_drops()
            self.finish_output()
            return code
        finally:
            self.close()
            if self.records is not None:
                import shutil

                shutil.rmtree(self.records, ignore_errors=True)


def _plan_size(plan: Plan) -> Optional[int]:
    """How many instances the whole plan has (``--instance-idx`` starts only some of them)."""
    for instance in plan.instances:
        total = instance.env.get("XLAUNCH_NINSTANCES", "")
        if total.isdigit():
            return int(total)
    return len(plan.instances)


def run_plan(plan: Plan, *, log_dir: Optional[str] = None, log_file_prefix: str = "xlaunch",
             keep_going: bool = False, grace_period: float = 5.0, quiet: bool = False,
             summary_json: Optional[str] = None, notes: Sequence[str] = ()) -> int:
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
    * Unless ``quiet``, ``notes`` (what the options were taken to mean), the plan's warnings, a start
      line and a summary per instance go to stderr, the first three once the log files are open;
      ``summary_json`` names a file for the summary as JSON.
    """
    return _PlanRunner(plan, log_dir=log_dir, log_file_prefix=log_file_prefix, keep_going=keep_going,
                       grace_period=grace_period, quiet=quiet, summary_json=summary_json, notes=notes).run()
