"""The torchrun front at run time (``xlaunch --nproc-per-node N``; planned and started by
:mod:`xlaunch.launcher.distributed.launch`): torch's elastic agent runs as a child of xlaunch, in
its own session (:mod:`xlaunch.launcher.distributed.agent`), and xlaunch supervises it and its
ranks as the runner supervises instances (:class:`xlaunch.launcher.run.supervisor.Supervisor`): a pipe per rank
(``[i]`` lines, per-rank logs), each rank registered as it starts (restarts too), seen ending
through a pidfd (its status read from its zombie, else from the agent's report), observed and
summarised; a rank failing on its own stops the others (SIGTERM, SIGKILL after the grace period,
without the agent's fixed 30 s); signals go to the agent and every rank group; the watchdog knows
every group. docs/distributed.md tells the whole of it.

Exit status: 128+N after signal N (unless a rank failed on its own first), else the agent's
(0, or the first failed rank's status, after any restarts), else the first failed rank's.
"""
from __future__ import annotations

import os
import selectors
import signal
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional, Sequence

    from xlaunch.launcher.plan.records import Plan

from xlaunch.launcher.distributed.channels import Channels
from xlaunch.launcher.plan.records import Instance
from xlaunch.launcher.run import reporting, spawning
from xlaunch.launcher.run.child import (Child, RankProcess, exists, has_ended, is_zombie, status_code, status_text,
                                        zombie_status)
from xlaunch.launcher.run.console import InstanceStream
from xlaunch.launcher.run.strays import Strays
from xlaunch.launcher.run.supervisor import Supervisor


STOPS = (128 + signal.SIGTERM, 128 + signal.SIGKILL)     # how a rank is stopped (a crash is the rank's own)


class FrontSupervisor(Supervisor):
    """Runs torch's agent and supervises it and its ranks. Construct, call :meth:`run` once."""

    noun = "rank"

    def __init__(self, plan: Plan, agent_argv: list[str], agent_env: dict[str, str], *,
                 log_dir: Optional[str], log_file_prefix: str, grace_period: float, quiet: bool,
                 summary_json: Optional[str], torchrun: list[str], channels_var: str,
                 start_timeout: Optional[float] = None, waiting_for: str = "torch's agent",
                 notes: Sequence[str] = (), warnings: Sequence[str] = ()) -> None:
        super().__init__(grace_period=grace_period, quiet=quiet, summary_json=summary_json)
        self.notes, self.warnings = tuple(notes), tuple(warnings)
        # every rank must have started once within start_timeout of the agent's start (its
        # rendezvous, bounded by the same --rdzv-timeout, plus the agent's own start-up)
        self.start_timeout = start_timeout
        self.waiting_for = waiting_for
        self.start_deadline: Optional[float] = None
        self.start_timed_out = False
        self.plan = plan
        self.agent_instance = Instance(index=-1, cpus=(), mem_nodes=(), env=dict(agent_env),
                                       argv=tuple(agent_argv), bind="none", membind="none")
        self.log_dir = log_dir
        self.prefix = log_file_prefix
        self.torchrun = torchrun
        self.channels_var = channels_var            # where the agent's environment names the channels
        self.channels: Optional[Channels] = None
        self.agent: Optional[Child] = None
        self.agent_result: dict[str, Any] = {}
        self.attempts: dict[int, int] = {}
        self.rank_pids: dict[int, tuple[int, int]] = {}     # pid -> (rank, attempt), every attempt's
        self.pidfds: dict[int, Child] = {}
        self.agent_exited = False                   # the agent exited (rather than being killed)
        self.retired: list[Child] = []              # groups of earlier attempts, while anything is left
        self.earlier: list[dict[str, Any]] = []     # how each rank's earlier attempts ended (--max-restarts)

    # ---------------------------------------------------------------- who is who

    def label(self, child: Child) -> str:
        return "the agent" if child is self.agent else f"rank {child.instance.index}"

    def groups(self) -> list[Child]:
        return [*self.children, *self.retired, *([self.agent] if self.agent is not None else [])]

    def pipes(self) -> list[Child]:
        return [c for c in self.children if c.fd is not None]

    def registry_fd(self) -> Optional[int]:
        return self.channels.registry if self.channels is not None else None

    # ---------------------------------------------------------------- start

    def open_channels(self) -> None:
        self.channels = Channels(len(self.plan.instances))
        indices = [i.index for i in self.plan.instances]
        if self.log_dir is not None:
            from xlaunch.launcher.run.logfiles import open_log_files

            self.logs = open_log_files(self.log_dir, self.prefix, indices, total=len(indices), kind="rank")
        for instance in self.plan.instances:
            log = self.logs.instances[instance.index] if self.logs is not None else None
            child = Child(instance, InstanceStream(instance.index, self.console, log))
            child.fd = self.channels.outputs[instance.index]
            self.children.append(child)
            self.watch_pipe(child)
        self.selector.register(self.channels.registry, selectors.EVENT_READ, self.on_registrations)
        if self.logs is not None and self.logs.kept:
            self.say(f"earlier logs kept as {', '.join(os.path.basename(p) for p in self.logs.kept[:2])}"
                     + (f" and {len(self.logs.kept) - 2} more" if len(self.logs.kept) > 2 else ""))

    def start_agent(self, single_threaded: bool) -> None:
        assert self.channels is not None
        instance = self.agent_instance
        instance.env[self.channels_var] = self.channels.path
        agent = Child(instance, InstanceStream(-1, self.messages, None))
        agent.stream.prefix = b"[agent] "
        agent.started = time.monotonic()
        if self.start_timeout is not None:
            self.start_deadline = agent.started + self.start_timeout
        try:
            agent.proc = spawning.spawn(instance, stdin=spawning.stdin_for(len(self.children)),
                                        die_with_parent=single_threaded, memory=spawning.MemoryPolicy())
        except OSError as error:
            self.say(f"torch's agent could not start: {error.strerror or error}", warning=True)
            agent.status, agent.text, agent.ended = 1, f"not started ({error})", time.monotonic()
            self.agent = agent
            return
        self.agent = agent
        if self.watchdog is not None:
            self.watchdog.watch(agent.pid)
        agent.group_alive = True
        agent.text = "running"
        agent.fd = agent.proc.stdout.fileno()
        self.selector.register(agent.fd, selectors.EVENT_READ, agent)
        self.log(f"agent started: pid {agent.pid}: {' '.join(instance.argv)}")

    def ended_on_its_own(self, child: Child) -> bool:
        """A rank (torch's agent's child) that has ended, a zombie or already reaped by the agent, and
        that the agent had not set out to stop (its note, written before it signals: read after the
        rank was seen ended, so a rank ended before any stop of the agent's is never taken for one)."""
        if child is self.agent or self.channels is None:
            return super().ended_on_its_own(child)
        return has_ended(child.pid) and child.pid not in self.channels.agent_stopping()

    def _killpg(self, child: Child, number: int) -> None:
        """SIGINT reaches the agent as SIGTERM until a rank started: before torch's handlers (they
        come with the ranks) Python would raise ``KeyboardInterrupt`` wherever the agent is, in an
        import or the rendezvous, and print its traceback; SIGTERM ends it quietly."""
        if number == signal.SIGINT and child is self.agent and not self.attempts:
            self.log("SIGINT to the agent before its ranks started: SIGTERM")
            number = signal.SIGTERM
        super()._killpg(child, number)

    def release_pipe(self, child: Child) -> None:
        if child is self.agent:
            if child.proc is not None and child.proc.stdout is not None:
                child.proc.stdout.close()
        elif self.channels is not None and self.channels.outputs.pop(child.instance.index, None) is not None:
            os.close(child.fd)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- ranks

    def on_registrations(self) -> None:
        assert self.channels is not None
        for pgid, local, pid in self.channels.read_registrations():
            if not 0 <= local < len(self.children):
                continue
            if self.watchdog is not None:
                self.watchdog.watch(pgid)
            self.rank_started(self.children[local], pid, pgid)

    def rank_started(self, child: Child, pid: int, pgid: int) -> None:
        index = child.instance.index
        attempt = self.attempts[index] = self.attempts.get(index, 0) + 1
        if child.proc is not None and child.ended is None:
            self.rank_ended(child, None, last_output=False)   # the agent replaced it without us seeing the end
        self._status_from_agent(child)
        self._stopped_by_agent(child, attempt - 1)
        if child.proc is not None:                  # the summary's rows are the last attempt's: keep this one
            self.earlier.append({"attempt": attempt - 1, "rank": index, "exit_code": child.status,
                                 "status": child.text + (f" ({child.stopped_by})" if child.stopped_by else "")})
        if child.proc is not None and child.group_alive:    # the last attempt's group lives on: keep
            retired = Child(child.instance, child.stream, proc=child.proc, started=child.started,   # stopping it
                            ended=child.ended, status=child.status, text=child.text, stopped_by=child.stopped_by,
                            group_alive=True, kill_at=child.kill_at, notes=list(child.notes))
            self.retired.append(retired)
        child.proc = RankProcess(pid, pgid)
        self.rank_pids[pid] = (index, attempt)
        child.started, child.ended, child.status = time.monotonic(), None, None
        child.text, child.stopped_by, child.kill_at, child.observer = "running", "", None, None
        child.group_alive = True
        child.notes[:] = []                          # a new group: its leftovers are looked at afresh
        self.log(f"rank {index} started: pid {pid}" + (f" (attempt {attempt})" if attempt > 1 else ""))
        opener = getattr(os, "pidfd_open", None)     # Linux 5.3: without it, reap() polls
        try:
            pidfd = opener(pid) if opener is not None else None
        except OSError:                              # already gone (or no pidfds): seen by reap()
            pidfd = None
        if pidfd is not None:
            process = child.proc
            self.pidfds[pidfd] = child
            self.selector.register(pidfd, selectors.EVENT_READ, lambda: self.on_rank_exit(pidfd, child, process))
        if self.interrupted is not None:             # started after xlaunch was told to stop
            self.signal_groups(self.interrupted, f"{self._signal_text()} forwarded", targets=[child])

    def _signal_text(self) -> str:
        from xlaunch.launcher.run.signals import signal_name

        return signal_name(self.interrupted or 0)

    def on_rank_exit(self, pidfd: int, child: Child, process: object) -> None:
        self.selector.unregister(pidfd)
        os.close(pidfd)
        self.pidfds.pop(pidfd, None)
        if child.proc is process and child.ended is None:
            self.rank_ended(child, zombie_status(child.pid))

    def rank_ended(self, child: Child, how: Optional[tuple[int, int]], *, last_output: bool = True) -> None:
        """``child``'s process ended (``how``: from its zombie, else None). ``last_output``: what it wrote is all
        in its pipe now; read it, and complete its unfinished last line, so that a restarted rank's first line
        starts a line of its own (it was glued to the earlier attempt's last words)."""
        child.ended = time.monotonic()
        if last_output and child.fd is not None:
            self.drain(child)
            child.stream.finish_line()
        if how is not None:
            child.status, child.text = status_code(*how), status_text(*how)
        else:
            child.status, child.text = None, "ended"
        if child.proc is not None:
            child.proc.returncode = child.status
        self.log(f"rank {child.instance.index} (pid {child.pid}) ended: {child.text} after "
                 f"{child.ended - child.started:.3f}s" + (f" ({child.stopped_by})" if child.stopped_by else ""))
        if not child.status or child.stopped_by or self.interrupted is not None or self._agent_stopped(child):
            return
        if self.first_failure is None:
            self.first_failure = child
            if self.channels is not None:
                self.channels.note_first_failure(child.instance.index, child.pid, child.status)
        others = [c for c in self.children if c is not child and c.running and not c.stopped_by]
        if others:
            self.say(f"rank {child.instance.index} failed ({child.text}): stopping the others "
                     f"(SIGTERM, SIGKILL after {self.grace:g}s)")
            self.signal_groups(signal.SIGTERM, f"stopped after rank {child.instance.index} failed", targets=others)

    # ---------------------------------------------------------------- reaping

    def reap(self) -> None:
        """Reap the agent and orphans (xlaunch is their subreaper); stop what ranks left behind."""
        ranks = {c.pid: c for c in self.children if c.proc is not None and c.ended is None}
        while True:
            try:
                result = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if result is None or result.si_pid == 0:
                break
            if self.agent is not None and result.si_pid == self.agent.pid and self.agent.ended is None:
                self.agent_ended(result.si_code, result.si_status)
            elif result.si_pid in ranks:             # a rank orphaned by a dead agent
                self.rank_ended(ranks.pop(result.si_pid), (result.si_code, result.si_status))
        watched = set(map(id, self.pidfds.values()))
        for child in ranks.values():                 # no pidfd: look whether it still exists
            if id(child) not in watched and child.ended is None and not exists(child.pid):
                self.rank_ended(child, None)
        for child in self.groups():
            if child.ended is not None and child.group_alive and not is_zombie(child.pid):
                self.check_group(child)

    def agent_ended(self, wait_code: int, value: int) -> None:
        agent = self.agent
        assert agent is not None and self.channels is not None
        agent.ended = time.monotonic()
        agent.status, agent.text = status_code(wait_code, value), status_text(wait_code, value)
        agent.proc.returncode = agent.status
        self.agent_exited = wait_code == os.CLD_EXITED
        self.log(f"the agent (pid {agent.pid}) ended: {agent.text}")
        try:
            import json

            with open(self.channels.result_path, encoding="utf-8") as report:
                self.agent_result = json.load(report)
        except (OSError, ValueError):
            self.agent_result = {}
        left = [c for c in [*self.children, *self.retired] if c.group_alive and c.kill_at is None]
        if left:
            self.log(f"the agent ended: stopping what is left of rank(s) {', '.join(str(c.instance.index) for c in left)}")
            self.signal_groups(signal.SIGTERM, "the agent ended", targets=left)

    def finished(self) -> bool:
        return all(c.done for c in self.groups())

    def next_due(self) -> Optional[float]:
        due = reporting.observe(self.children, time.monotonic())
        if self.start_deadline is not None:
            due = self.start_deadline if due is None else min(due, self.start_deadline)
        return due

    def shift_deadlines(self, paused: float) -> None:
        super().shift_deadlines(paused)
        if self.start_deadline is not None:   # the ranks' start waited as long as xlaunch was stopped
            self.start_deadline += paused

    def enforce_deadlines(self) -> None:
        super().enforce_deadlines()
        deadline = self.start_deadline
        if deadline is None or time.monotonic() < deadline:
            return
        self.start_deadline = None
        started = len(self.attempts)
        agent = self.agent
        if started >= len(self.children) or agent is None or agent.ended is not None or self.interrupted is not None:
            return
        self.start_timed_out = True
        message = (f"--nproc-per-node: {started} of {len(self.children)} ranks started within "
                   f"{self.start_timeout:g} s of torch's agent; waited for {self.waiting_for}: stopping the job")
        self.log("error: " + message)
        self._write_stderr(f"xlaunch: error: {message}\n")     # even with -q
        self.signal_groups(signal.SIGTERM, "the ranks did not start in time")

    # ---------------------------------------------------------------- the end

    def fill_statuses(self) -> None:
        """Ranks whose status xlaunch did not see: the agent's report (failures, else success)."""
        failures = self.agent_result.get("failures") or {}
        ok = self.agent_result.get("status") == 0
        for child in self.children:
            self._status_from_agent(child)
            if child.proc is None or child.status is not None:
                continue
            code = failures.get(str(child.instance.index), 0 if ok else None)
            if code is not None:
                child.status = code
                child.text = f"exit {code}" if code < 128 else status_text(os.CLD_KILLED, code - 128)
        self._attribute_stops()

    def _agent_stopped(self, child: Child) -> bool:
        """``child`` was stopped by torch's agent (SIGTERM or SIGKILL, its pid in the agent's note): it did not
        fail on its own, whoever sees its end first (xlaunch may read its zombie before the failed rank's,
        when the agent reaped that one first)."""
        return child.status in STOPS and self.channels is not None and child.pid in self.channels.agent_stopping()

    def _stopped_by_agent(self, child: Child, attempt: int) -> None:
        """An earlier attempt's rank the agent stopped reads 'stopped after rank N failed', N the rank of that
        attempt the agent reaped failing (its note of exits; xlaunch never saw that rank's status)."""
        if child.proc is None or child.stopped_by or not self._agent_stopped(child):
            return
        failed = sorted(self.rank_pids[pid][0] for pid, code in self.channels.agent_exits().items()  # type: ignore[union-attr]
                        if code not in (0, -signal.SIGTERM, -signal.SIGKILL) and self.rank_pids.get(pid, (-1, 0))[1]
                        == attempt and self.rank_pids[pid][0] != child.instance.index)
        if failed:
            child.stopped_by = f"stopped after rank {failed[0]} failed"

    def _status_from_agent(self, child: Child) -> None:
        """A rank the agent reaped before xlaunch read its status: how it ended, from the agent's note."""
        if child.proc is None or child.ended is None or child.status is not None or self.channels is None:
            return
        code = self.channels.agent_exits().get(child.pid)
        if code is not None:
            how = (os.CLD_KILLED, -code) if code < 0 else (os.CLD_EXITED, code)
            child.status, child.text = status_code(*how), status_text(*how)
            child.proc.returncode = child.status

    def _attribute_stops(self) -> None:
        """When the agent reaped a failed rank before xlaunch read its status, the agent (not
        xlaunch) stopped the others: they still were stopped after that rank failed (killed by SIGTERM,
        or SIGKILL after the grace period; a rank killed by another signal, SIGSEGV, failed on its own).
        The agent's root cause (``first`` in its report) comes before a rank xlaunch saw killed by SIGTERM."""
        named = self.agent_result.get("first")
        root = next((c for c in self.children if named is not None and str(c.instance.index) == str(named)
                     and c.status and not c.stopped_by and c.ended is not None), None)
        stops = STOPS
        own = [c for c in self.children if c.status and c.status not in stops and not c.stopped_by
               and c.ended is not None]
        if root is None and not own:
            return
        first = root or self.first_failure or min(own, key=lambda c: c.ended)
        if (self.first_failure is None or root is not None) and self.interrupted is None:
            self.first_failure = first
        for child in self.children:
            if child is not first and child.status in stops and not child.stopped_by \
                    and child.ended is not None and (child.ended >= first.ended or root is not None) \
                    and self.interrupted is None:
                child.stopped_by = f"stopped after rank {first.instance.index} failed"

    def exit_status(self) -> int:
        agent = self.agent
        if self.start_timed_out and self.interrupted is None and self.first_failure is None:
            return 1
        if self.interrupted is not None and self.first_failure is None:
            return 128 + self.interrupted
        if agent is not None and agent.status is not None and self.agent_exited:
            return agent.status
        if self.first_failure is not None and self.first_failure.status:
            return self.first_failure.status
        if self.interrupted is not None:
            return 128 + self.interrupted
        return agent.status if agent is not None and agent.status else 1

    def run(self) -> int:
        try:
            self.open_channels()      # an OptionError here: nothing started, nothing left behind
            for line in reporting.plan_lines(self.plan, keep_going=False, grace=self.grace):
                self.log(line)
            self.plan_messages(self.notes, self.warnings)
            count = len(self.plan.instances)
            cpus = sum(len(i.cpus) for i in self.plan.instances)
            self.say(f"starting torch's agent for {count} rank{'s' if count != 1 else ''} on {cpus} "
                     f"CPU{'s' if cpus != 1 else ''}: allocator {self.plan.allocator}, OpenMP {self.plan.openmp}")
            self.signals.install(self.log)
            single_threaded = spawning.single_threaded()
            self.become_subreaper()
            strays = Strays(single_threaded and self.saved_subreaper is not None)   # reaped with the rest
            try:
                self.start_watchdog()
                self.start_agent(single_threaded)
                self.loop()
                strays.stop([self.watchdog.pid] if self.watchdog is not None else [], self.grace, self.say, "rank")
            except BaseException:
                self.kill_everything()
                raise
            finally:
                if self.watchdog is not None:
                    self.watchdog.stop()
                self.restore_subreaper()
            self.fill_statuses()
            code = self.exit_status()
            for warning in reporting.observation_warnings(self.children, self.plan):
                self.say(warning, warning=True)
            self.earlier.sort(key=lambda e: (e["attempt"], e["rank"]))
            for attempt in sorted({e["attempt"] for e in self.earlier}):   # restarts: said before the table
                ended = ", ".join(f"rank {e['rank']} {e['status']}" for e in self.earlier if e["attempt"] == attempt)
                self.say(f"attempt {attempt} of {max(self.attempts.values())} (torch's agent restarted the ranks): "
                         f"{ended}")
            self.summarize(code, self.plan, {"distributed": {"engine": "torch.distributed.run",
                                                             "torchrun_options": self.torchrun,
                                                             "attempts": dict(sorted(self.attempts.items())),
                                                             "earlier_attempts": self.earlier}})
            self.report_drops()
            self.finish_output()
            return code
        finally:
            for pidfd in list(self.pidfds):
                os.close(pidfd)
            self.close()
            if self.channels is not None:
                self.channels.close()
