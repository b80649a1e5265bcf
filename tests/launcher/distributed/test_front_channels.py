"""The front's channels to its ranks, without torch: a rank attaches to its own pipe and registers;
a rank finding no front does not start; the watchdog stops a group that registered while the
front was being killed (it drains the registry nobody else will read)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from xlaunch.launcher.run.child import zombie_status
from xlaunch.launcher.distributed.channels import Channels, parse_registrations
from xlaunch.launcher.run.watchdog import Watchdog

REPO = Path(__file__).resolve().parents[3]

# what ``xlaunch --per-rank`` does under the front before it becomes the program, then the program
RANK = """\
import os, sys
from xlaunch.launcher.distributed.launch import attach_rank
problem = attach_rank(os.environ, int(sys.argv[1]))
if problem:
    sys.stderr.write(problem + "\\n")
    sys.exit(143)
os.execv(sys.executable, [sys.executable, "-c", "import sys; print('to stdout'); print('to stderr', file=sys.stderr)"])
"""


def _rank(channels_path: str, local: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLAUNCH_FRONT_CHANNELS": channels_path}
    return subprocess.run([sys.executable, "-c", RANK, str(local)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=30, start_new_session=True)   # as torch's agent starts ranks


def _read(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


def test_a_rank_writes_to_its_own_pipe_and_registers() -> None:
    channels = Channels(2)
    try:
        done = _rank(channels.path, 1)
        assert done.returncode == 0 and done.stdout == "" and done.stderr == ""   # all went to the pipe
        assert _read(channels.outputs[1]) == b"to stdout\nto stderr\n"
        assert _read(channels.outputs[0]) == b""
        registered = channels.read_registrations()
        assert len(registered) == 1 and registered[0][1] == 1 and registered[0][0] == registered[0][2]
    finally:
        path = channels.path
        channels.close()
    assert not os.path.exists(path)
    gone = _rank(path, 0)                                  # no front: the rank does not start
    assert gone.returncode == 143 and "front that started this rank is gone" in gone.stderr
    assert parse_registrations(b"+12 0 12\n+x 1 2\n+13 1\n") == [(12, 0, 12)]


def test_watchdog_stops_a_group_registered_while_the_front_died() -> None:
    channels = Channels(1)
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                                 "time.sleep(60)"], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert stubborn.stdout.readline() == b"ready\n"
        watchdog = Watchdog.start(0.3, channels.registry)
        writer = os.open(os.path.join(channels.path, "ranks"), os.O_WRONLY | os.O_NONBLOCK)
        os.write(writer, f"+{stubborn.pid} 0 {stubborn.pid}\n".encode())   # never read by the front
        os.close(writer)
        channels.close()                  # the front's registry ends go away with it...
        os.close(watchdog._fd)            # ...and so does its pipe to the watchdog: "xlaunch is gone"
        watchdog._fd = None
        started = time.monotonic()
        assert stubborn.wait(timeout=10) == -signal.SIGKILL        # SIGTERM ignored, SIGKILL after 0.3 s
        assert time.monotonic() - started < 3
        os.waitpid(watchdog.pid, 0)
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()
        stubborn.stdout.close()


def test_zombie_status_reads_exit_codes_and_signals() -> None:
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.send_signal(signal.SIGKILL)
    for proc in (exited, killed):
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)   # exited, still a zombie
    assert zombie_status(exited.pid) == (os.CLD_EXITED, 7)
    assert zombie_status(killed.pid) == (os.CLD_KILLED, signal.SIGKILL)
    assert zombie_status(os.getpid()) is None                     # running: no status
    exited.wait()
    killed.wait()


def test_ranks_the_agent_stopped_after_a_failure_it_reaped_first_are_told_so() -> None:
    """Under load torch's agent may reap a failed rank before xlaunch reads its status: the agent
    then stops the others itself. The summary still says they were stopped after that rank failed."""
    from xlaunch.launcher.plan.planner import Instance, Plan
    from xlaunch.launcher.run.child import Child
    from xlaunch.launcher.distributed.front import FrontSupervisor

    plan = Plan(tuple(Instance(i, (i,), (0,), {}, ("true",)) for i in range(3)))
    front = FrontSupervisor(plan, ["true"], {}, log_dir=None, log_file_prefix="x", grace_period=1, quiet=True,
                            summary_json=None, torchrun=[], channels_var="X")
    ranks = [Child(instance, None) for instance in plan.instances]
    for rank, (ended, status, text) in zip(ranks, [(12.0, 137, "killed by SIGKILL"), (10.0, None, "ended"),
                                                    (11.0, 0, "exit 0")]):
        rank.proc, rank.ended, rank.status, rank.text = object(), ended, status, text
    front.children = ranks
    front.agent_result = {"status": 1, "failures": {"1": 3, "0": 137}}
    front.fill_statuses()
    assert (ranks[1].status, ranks[1].text, ranks[1].stopped_by) == (3, "exit 3", "")
    assert front.first_failure is ranks[1]
    assert ranks[0].stopped_by == "stopped after rank 1 failed"
    assert ranks[2].stopped_by == ""          # it ended on its own, with 0
    assert front.exit_status() == 3


# the front with an agent that never starts its ranks (a rendezvous that never completes)
STUCK_AGENT = """\
import os, sys
from xlaunch.launcher.plan.planner import Instance, Plan
from xlaunch.launcher.distributed.front import FrontSupervisor
cpu = min(os.sched_getaffinity(0))
plan = Plan(tuple(Instance(i, (cpu,), (), dict(os.environ), ("true",)) for i in range(2)))
agent = [sys.executable, "-c", "import time; time.sleep(60)"]
sys.exit(FrontSupervisor(plan, agent, dict(os.environ), log_dir=None, log_file_prefix="xlaunch", grace_period=1.0,
                         quiet=True, summary_json=None, torchrun=[], channels_var="XLAUNCH_FRONT_CHANNELS",
                         start_timeout=1.0, waiting_for="a stuck rendezvous").run())
"""


def test_ranks_that_never_start_stop_the_job_within_the_bound() -> None:
    """--rdzv-timeout bounds the front's wait for its ranks: one error line naming what it waited
    for, exit status 1, the agent stopped (SIGTERM; SIGKILL after the grace period)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK_AGENT], cwd=REPO, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == ["xlaunch: error: --nproc-per-node: 0 of 2 ranks started within 1 s of "
                                        "torch's agent; waited for a stuck rendezvous: stopping the job"], done.stderr
    assert elapsed < 1.0 + 1.0 + 3.0      # the bound, the grace period (the agent dies at SIGTERM), start-up


# a stand-in for torch's agent: starts two "ranks" (each in a session of its own) that exit 3 at once,
# prints their pids and leaves them zombies (never reaps them) until its stdin closes
AGENT_OF_ZOMBIES = """\
import subprocess, sys
ranks = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True) for _ in range(2)]
print(*(r.pid for r in ranks), flush=True)
sys.stdin.read()
"""


def _zombie_ranks() -> tuple[subprocess.Popen, list[int]]:
    agent = subprocess.Popen([sys.executable, "-c", AGENT_OF_ZOMBIES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    pids = [int(p) for p in agent.stdout.readline().split()]
    deadline = time.monotonic() + 30
    while any(zombie_status(pid) is None for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return agent, pids


def test_ranks_that_failed_at_the_same_moment_each_failed_on_their_own(tmp_path: Path) -> None:
    """Both ranks exit 3 at once; when xlaunch sees rank 0's end and stops the others, rank 1 has already
    ended (a zombie of torch's agent): its row is 'exit 3', not 'exit 3 (stopped after rank 0 failed)'. A rank
    the agent had set out to stop (its pid in the agent's note) keeps the label."""
    from xlaunch.launcher.distributed.channels import AGENT_STOPPING
    from xlaunch.launcher.distributed.front import FrontSupervisor
    from xlaunch.launcher.plan.planner import Instance, Plan
    from xlaunch.launcher.run.child import Child, RankProcess

    for agent_stopped in (False, True):
        agent, pids = _zombie_ranks()
        plan = Plan(tuple(Instance(i, (i,), (0,), {}, ("true",)) for i in range(2)))
        front = FrontSupervisor(plan, ["true"], {}, log_dir=None, log_file_prefix="x", grace_period=1, quiet=True,
                                summary_json=None, torchrun=[], channels_var="X")
        front.channels = Channels(2)
        try:
            if agent_stopped:
                Path(front.channels.path, AGENT_STOPPING).write_text(f"{pids[1]}\n")
            front.children = [Child(instance, None) for instance in plan.instances]
            for rank, pid in zip(front.children, pids):
                rank.proc, rank.started, rank.group_alive = RankProcess(pid, pid), time.monotonic(), True
            front.rank_ended(front.children[0], zombie_status(pids[0]))
            assert front.first_failure is front.children[0]
            assert front.children[1].stopped_by == ("stopped after rank 0 failed" if agent_stopped else "")
            front.rank_ended(front.children[1], zombie_status(pids[1]))
            assert [c.text for c in front.children] == ["exit 3", "exit 3"]
        finally:
            front.channels.close()
            agent.communicate("")


def test_the_agent_notes_the_ranks_it_is_about_to_stop(tmp_path: Path) -> None:
    """Before torch's agent signals its workers it appends the pids of those still running (torch signals
    only those) to the front's note, which the front reads back."""
    from types import SimpleNamespace

    from xlaunch.launcher.distributed.agent import _note_stopping
    from xlaunch.launcher.distributed.channels import AGENT_STOPPING

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        handlers = {0: SimpleNamespace(proc=ended), 1: SimpleNamespace(proc=running)}
        context = SimpleNamespace(subprocess_handlers=handlers)
        channels = Channels(1)
        try:
            path = os.path.join(channels.path, AGENT_STOPPING)
            _note_stopping(context, path)
            _note_stopping(SimpleNamespace(pids=lambda: {0: 11, 1: 12}), path)   # no handlers: every worker
            assert channels.agent_stopping() == {running.pid, 11, 12}
        finally:
            channels.close()
    finally:
        running.kill()
        running.wait()


def test_a_rank_the_agent_reaped_first_ends_as_the_agents_note_says(tmp_path: Path) -> None:
    """Under load torch's agent reaps a rank before xlaunch reads its zombie: the agent notes how each worker
    it stopped ended (PID RETURNCODE), and the earlier attempt's line says 'killed by SIGTERM' (it said
    'ended'), as does the last attempt's row."""
    from types import SimpleNamespace

    from xlaunch.launcher.distributed.agent import _note_exits
    from xlaunch.launcher.distributed.channels import AGENT_EXITS
    from xlaunch.launcher.distributed.front import FrontSupervisor
    from xlaunch.launcher.plan.planner import Instance, Plan
    from xlaunch.launcher.run.child import Child, RankProcess

    plan = Plan(tuple(Instance(i, (i,), (0,), {}, ("true",)) for i in range(2)))
    front = FrontSupervisor(plan, ["true"], {}, log_dir=None, log_file_prefix="x", grace_period=1, quiet=True,
                            summary_json=None, torchrun=[], channels_var="X")
    front.channels = Channels(2)
    try:
        handlers = {0: SimpleNamespace(proc=SimpleNamespace(pid=4000001, returncode=-15)),
                    1: SimpleNamespace(proc=SimpleNamespace(pid=4000002, returncode=3)),
                    2: SimpleNamespace(proc=SimpleNamespace(pid=4000003, returncode=None))}
        _note_exits(SimpleNamespace(subprocess_handlers=handlers), os.path.join(front.channels.path, AGENT_EXITS))
        assert front.channels.agent_exits() == {4000001: -15, 4000002: 3}
        front.children = [Child(instance, None) for instance in plan.instances]
        rank = front.children[0]
        rank.proc, rank.started, rank.ended = RankProcess(4000001, 4000001), 1.0, 2.0
        rank.status, rank.text, rank.stopped_by = None, "ended", "stopped after rank 1 failed"
        front.attempts[0] = 1
        front.rank_started(rank, 4000004, 4000004)                  # the agent's second attempt (no such pid)
        assert front.earlier == [{"attempt": 1, "rank": 0, "exit_code": 143,
                                  "status": "killed by SIGTERM (stopped after rank 1 failed)"}]
        Path(front.channels.path, AGENT_EXITS).write_text("4000004 -15\n")
        rank.ended = 3.0
        front.fill_statuses()
        assert (rank.status, rank.text) == (143, "killed by SIGTERM")
    finally:
        front.channels.close()


def test_a_rank_that_crashed_as_another_failed_is_not_said_to_be_stopped() -> None:
    """Rank 0 exits 3 and rank 1 dies of SIGSEGV in the same moment, rank 2 is stopped by the agent: only the
    stop signals (SIGTERM, SIGKILL) read 'stopped after rank 0 failed'; the crash was its own (it read
    'killed by SIGSEGV (stopped after rank 0 failed)')."""
    from xlaunch.launcher.distributed.front import FrontSupervisor
    from xlaunch.launcher.plan.planner import Instance, Plan
    from xlaunch.launcher.run.child import Child

    plan = Plan(tuple(Instance(i, (i,), (0,), {}, ("true",)) for i in range(3)))
    front = FrontSupervisor(plan, ["true"], {}, log_dir=None, log_file_prefix="x", grace_period=1, quiet=True,
                            summary_json=None, torchrun=[], channels_var="X")
    ranks = [Child(instance, None) for instance in plan.instances]
    for rank, (ended, status, text) in zip(ranks, [(10.0, 3, "exit 3"), (10.1, 139, "killed by SIGSEGV"),
                                                    (10.2, 143, "killed by SIGTERM")]):
        rank.proc, rank.ended, rank.status, rank.text = object(), ended, status, text
    front.children = ranks
    front.agent_result = {"status": 3, "first": "0", "failures": {"0": 3, "1": 139, "2": 143}}
    front.fill_statuses()
    assert [r.stopped_by for r in ranks] == ["", "", "stopped after rank 0 failed"]
    assert front.first_failure is ranks[0]


def test_a_restarted_ranks_first_line_is_not_glued_to_the_last_attempts_unfinished_one() -> None:
    """Attempt 1 of rank 0 wrote 'progress 50%' without a newline and failed; attempt 2 writes 'fresh'. The
    console said '[0] progress 50%fresh' (one pipe per rank across restarts); the log too."""
    import io

    from xlaunch.launcher.distributed.front import FrontSupervisor
    from xlaunch.launcher.plan.planner import Instance, Plan
    from xlaunch.launcher.run.child import Child, RankProcess
    from xlaunch.launcher.run.console import Console, InstanceStream

    plan = Plan((Instance(0, (0,), (0,), {}, ("true",)),))
    console, log = io.BytesIO(), io.BytesIO()
    front = FrontSupervisor(plan, ["true"], {}, log_dir=None, log_file_prefix="x", grace_period=1, quiet=True,
                            summary_json=None, torchrun=[], channels_var="X")
    front.console = Console(console)
    front.channels = Channels(1)
    try:
        rank = Child(plan.instances[0], InstanceStream(0, front.console, log))
        rank.fd, rank.proc, rank.started = front.channels.outputs[0], RankProcess(4000001, 4000001), 1.0
        front.children = [rank]
        writer = os.open(os.path.join(front.channels.path, "out_0"), os.O_WRONLY)
        try:
            os.write(writer, b"starting\nprogress 50%")
            front.rank_ended(rank, (os.CLD_EXITED, 3))           # what it wrote is read now, its line completed
            os.write(writer, b"fresh\n")                          # the next attempt
            front.drain(rank)
        finally:
            os.close(writer)
        assert console.getvalue() == b"[0] starting\n[0] progress 50%\n[0] fresh\n"
        assert log.getvalue() == b"starting\nprogress 50%\nfresh\n"
    finally:
        front.channels.close()


def test_a_rank_the_agent_stopped_seen_before_the_rank_it_reaped_failing_is_said_stopped(tmp_path: Path) -> None:
    """Under load the agent reaps the failing rank (exit 3) before xlaunch reads it, then stops the other with
    SIGTERM, whose zombie xlaunch reads first: that rank read as the attempt's failure, 'killed by SIGTERM'
    with no word of the stop (seen in CI). The agent's notes (the pids it stops, how those it reaped ended)
    say it was stopped after rank 1 failed."""
    from xlaunch.launcher.distributed.channels import AGENT_EXITS, AGENT_STOPPING
    from xlaunch.launcher.distributed.front import FrontSupervisor
    from xlaunch.launcher.plan.planner import Instance, Plan
    from xlaunch.launcher.run.child import Child

    plan = Plan(tuple(Instance(i, (i,), (0,), {}, ("true",)) for i in range(2)))
    front = FrontSupervisor(plan, ["true"], {}, log_dir=None, log_file_prefix="x", grace_period=1, quiet=True,
                            summary_json=None, torchrun=[], channels_var="X")
    front.channels = Channels(2)
    try:
        front.children = [Child(instance, None) for instance in plan.instances]
        stopped, failing = front.children
        front.rank_started(stopped, 4000001, 4000001)               # attempt 1 (no such pids)
        front.rank_started(failing, 4000002, 4000002)
        Path(front.channels.path, AGENT_STOPPING).write_text("4000001\n")
        front.rank_ended(stopped, (os.CLD_KILLED, signal.SIGTERM))   # its zombie, read first
        assert front.first_failure is None                           # not a failure of its own
        front.rank_ended(failing, None)                              # reaped by the agent: status unknown
        Path(front.channels.path, AGENT_EXITS).write_text("4000001 -15\n4000002 3\n")
        front.rank_started(stopped, 4000003, 4000003)               # attempt 2
        front.rank_started(failing, 4000004, 4000004)
        assert front.earlier == [
            {"attempt": 1, "rank": 0, "exit_code": 143, "status": "killed by SIGTERM (stopped after rank 1 failed)"},
            {"attempt": 1, "rank": 1, "exit_code": 3, "status": "exit 3"}]
    finally:
        front.channels.close()
