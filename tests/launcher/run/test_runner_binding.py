"""Native binding primitives and run_plan called in-process (threads, double signals, stdin)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from xlaunch.cpulist import parse_cpulist
from xlaunch.launcher.run import binding
from xlaunch.launcher.run.console import Console, InstanceStream
from xlaunch.launcher.plan.planner import Instance, Plan
from xlaunch.launcher.run.runner import run_plan

pytestmark = pytest.mark.live

ALLOWED = sorted(os.sched_getaffinity(0))
REPO = Path(__file__).resolve().parents[3]


def _status_field(pid: int | str, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(name)


def test_nodemask_layout_and_maxnode() -> None:
    mask, maxnode = binding._nodemask([0, 3, 64])
    assert list(mask) == [0b1001, 1]
    assert maxnode == 2 * 64 + 1


def test_mempolicy_for_each_mode() -> None:
    assert binding.mempolicy_for("bind", (1, 0)) == (binding.MPOL_BIND, (0, 1))
    assert binding.mempolicy_for("interleave", (0, 1)) == (binding.MPOL_INTERLEAVE, (0, 1))
    assert binding.mempolicy_for("preferred", (2, 1)) == (binding.MPOL_PREFERRED, (1,))
    assert binding.mempolicy_for("none", (0,)) is None
    assert binding.mempolicy_for("bind", ()) is None
    with pytest.raises(ValueError):
        binding.mempolicy_for("everywhere", (0,))


def test_pinned_thread_applies_then_restores_and_children_inherit() -> None:
    before_cpus, before_policy = os.sched_getaffinity(0), binding.get_mempolicy()
    target = ALLOWED[-1]
    with binding.pinned_thread([target], (binding.MPOL_BIND, (0,))):
        assert os.sched_getaffinity(0) == {target}
        assert binding.get_mempolicy() == (binding.MPOL_BIND, (0,))
        child = subprocess.run(["cat", "/proc/self/status", "/proc/self/numa_maps"], capture_output=True,
                               text=True, check=True).stdout
    assert os.sched_getaffinity(0) == before_cpus
    assert binding.get_mempolicy() == before_policy
    allowed = next(line for line in child.splitlines() if line.startswith("Cpus_allowed_list:"))
    assert parse_cpulist(allowed.split(":")[1]) == (target,)
    assert " bind:0 " in child


def test_pinned_thread_refuses_policy_without_changing_anything() -> None:
    before = os.sched_getaffinity(0), binding.get_mempolicy()
    with pytest.raises(binding.MemoryPolicyRefused):
        with binding.pinned_thread([ALLOWED[0]], (binding.MPOL_BIND, (63,))):
            raise AssertionError("must not get here")
    assert (os.sched_getaffinity(0), binding.get_mempolicy()) == before


def test_pinned_thread_only_pins_the_calling_thread() -> None:
    other_seen: list[set[int]] = []
    release = threading.Event()

    def other() -> None:
        release.wait(10)
        other_seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=other)
    thread.start()
    with binding.pinned_thread([ALLOWED[0]], None):
        release.set()
        thread.join(10)
    assert other_seen == [set(ALLOWED)]


def test_die_with_parent_kills_child_when_its_parent_is_killed(tmp_path: Path) -> None:
    # middle process: starts a grandchild with PR_SET_PDEATHSIG, prints its pid, sleeps
    middle = (
        "import subprocess, sys, time\n"
        "from xlaunch.launcher import binding\n"
        "p = subprocess.Popen(['sleep', '300'], preexec_fn=lambda: binding.die_with_parent())\n"
        "print(p.pid, flush=True); time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", middle], cwd=REPO, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if _status_field(grandchild, "State").startswith("Z"):
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, signal.SIGKILL)
        raise AssertionError("grandchild survived its parent")


def test_console_and_stream_in_memory() -> None:
    import io

    sink = io.BytesIO()
    log = io.BytesIO()
    stream = InstanceStream(7, Console(sink), log, max_line=8)
    for piece in (b"ab", b"c\nde", b"f\n\n", b"0123456789abc", b"\ntail"):
        stream.feed(piece)
    stream.close()
    assert log.getvalue() == b"abc\ndef\n\n0123456789abc\ntail"
    assert sink.getvalue().split(b"\n") == [b"[7] abc", b"[7] def", b"[7] ", b"[7] 01234567",
                                            b"[7] 89abc", b"[7] tail", b""]


# ---------------------------------------------------------------- run_plan in this process

def _instance(index: int, argv: list[str], cpus: tuple[int, ...] | None = None) -> Instance:
    return Instance(index=index, cpus=cpus or (ALLOWED[index % len(ALLOWED)],), mem_nodes=(0,),
                    env=dict(os.environ), argv=tuple(argv))


def test_run_plan_in_process_restores_the_callers_state(capfd: pytest.CaptureFixture[str]) -> None:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)}
    before = os.sched_getaffinity(0), binding.get_mempolicy()
    status = run_plan(Plan((_instance(0, ["sh", "-c", "echo one; exit 4"]), _instance(1, ["echo", "two"]))),
                      keep_going=True)
    out, err = capfd.readouterr()
    assert status == 4
    assert "[0] one\n" in out and "[1] two\n" in out
    assert "exit 4" in err
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert (os.sched_getaffinity(0), binding.get_mempolicy()) == before
    assert binding.set_child_subreaper(False) is False  # restored (and stays off)


def test_run_plan_from_a_worker_thread(capfd: pytest.CaptureFixture[str]) -> None:
    """Not the main thread: no signal handlers, no preexec; pinning and statuses still work."""
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(
        run_plan(Plan((_instance(0, [sys.executable, "-c", code], cpus=(ALLOWED[-1],)),)), quiet=True)))
    thread.start()
    thread.join(60)
    out, _err = capfd.readouterr()
    assert results == [0]
    assert f"[0] [{ALLOWED[-1]}]" in out


def test_second_signal_kills_at_once(tmp_path: Path) -> None:
    stubborn = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(300)")
    script = (
        "import os, sys\n"
        "from xlaunch.launcher.plan.planner import Instance, Plan\n"
        "from xlaunch.launcher.run.runner import run_plan\n"
        f"i = Instance(0, ({ALLOWED[0]},), (0,), dict(os.environ), (sys.executable, '-c', {stubborn!r}))\n"
        "sys.exit(run_plan(Plan((i,)), grace_period=60))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert b"ready" in proc.stdout.readline()
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=20)
    assert time.monotonic() - started < 15  # far less than the 60 s grace period
    # needed SIGKILL, but it was stopped because of the user's Ctrl-C: 128 + SIGINT, not 137
    assert proc.returncode == 130, err.decode()
    assert "received SIGINT again" in err.decode()


def test_single_instance_reads_piped_stdin(tmp_path: Path) -> None:
    script = (
        "import os, sys\n"
        "from xlaunch.launcher.plan.planner import Instance, Plan\n"
        "from xlaunch.launcher.run.runner import run_plan\n"
        f"i = Instance(0, ({ALLOWED[0]},), (0,), dict(os.environ), ('tr', 'a-z', 'A-Z'))\n"
        "sys.exit(run_plan(Plan((i,)), quiet=True))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, input=b"piped in\n", capture_output=True,
                          timeout=30)
    assert done.returncode == 0
    assert done.stdout == b"[0] PIPED IN\n"
