"""Signals during start-up, and xlaunch killed outright: no hang, no traceback, nothing left running.

Each program records its pid (and its child's) in a file; after xlaunch returns, every recorded
process must be gone (zombies count as gone: they no longer run).
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from host_cpus import allowed_cores
from processes import running, wait_gone

REPO = Path(__file__).resolve().parents[3]
ALLOWED = sorted(os.sched_getaffinity(0))
# two instances where there are two cores (one under taskset -c 1: the signal paths are the same)
INSTANCES = min(2, allowed_cores())
TRIALS = int(os.environ.get("XLAUNCH_SIGNAL_TRIALS", "30"))

# a program that records itself and a child, both ignoring nothing, then waits
RECORDER = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen(['sleep', '60'])\n"
            "open(sys.argv[1], 'a').write(f'{os.getpid()} {child.pid}\\n')\n"
            "time.sleep(60)\n")
# the same, but the program and its child ignore SIGTERM (checkpointing trainers do)
STUBBORN = ("import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
            "open(sys.argv[1], 'a').write(f'{os.getpid()} {child.pid}\\n')\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")


def default_signals() -> None:
    """Children start with SIGINT/SIGHUP at their defaults, whatever the test runner inherited
    (a shell's background job ignores SIGINT, and an ignored signal stays ignored)."""
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)


def recorded(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [int(p) for line in path.read_text().splitlines() for p in line.split()]






def traceback_in_xlaunch(err: str) -> bool:
    """A traceback with a frame in xlaunch's code. (A Ctrl-C that lands while the interpreter
    itself starts, in ``site``, before any xlaunch code runs, is Python's to report; so is one in
    the package's ``__init__`` body, which every entry point runs before its handler can exist:
    seen once in CI under load, at ``class _MovedModules``.)"""
    ours = [frame for frame in re.findall(r'File "([^"]+)"', err) if frame.startswith(f"{REPO / 'xlaunch'}{os.sep}")]
    return "Traceback" in err and any(frame != str(REPO / "xlaunch" / "__init__.py") for frame in ours)


def python_still_starting(err: str) -> bool:
    """The signal landed while the interpreter itself was starting, before any of xlaunch ran: Python's
    own report, status 1 (a Traceback, or "Could not import runpy module" when it lands in ``-m``'s own
    import, seen in CI)."""
    return "Traceback" in err or err.startswith("Could not import runpy module")


def cleanup(pids: list[int]) -> None:
    for pid in running(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------ deterministic: between spawns

SIGNAL_AFTER_SPAWN = """
import os, signal, sys
from xlaunch.launcher.run import spawning
from xlaunch.launcher.plan.planner import Instance, Plan
from xlaunch.launcher.run.runner import run_plan

after, number, record, program = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
real_spawn, count = spawning.spawn, [0]

def spawn(*args, **kwargs):
    if count[0] == after:                 # the signal lands exactly here: while spawn `after` starts
        os.kill(os.getpid(), number)
    count[0] += 1
    return real_spawn(*args, **kwargs)

spawning.spawn = spawn
cpus = sorted(os.sched_getaffinity(0))
plan = Plan(tuple(Instance(i, (cpus[i % len(cpus)],), (), dict(os.environ), (sys.executable, '-c', program, record))
                  for i in range(3)))
sys.exit(run_plan(plan, grace_period=2))
"""


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda n: signal.Signals(n).name)
@pytest.mark.parametrize("after", [0, 1, 2])
def test_signal_between_spawns_starts_nothing_more_and_stops_the_started(tmp_path, after, number) -> None:
    record = tmp_path / "pids"
    proc = subprocess.run([sys.executable, "-c", SIGNAL_AFTER_SPAWN, str(after), str(int(number)), str(record), RECORDER],
                          cwd=REPO, capture_output=True, text=True, timeout=30, preexec_fn=default_signals)
    pids = recorded(record)
    try:
        assert proc.returncode == 128 + number, proc.stderr
        assert "Traceback" not in proc.stderr
        started = after + 1               # the instance being spawned starts, and gets the signal
        assert proc.stderr.count("not started") == 3 - started
        assert len(pids) <= 2 * started   # instances after it never ran
        assert wait_gone(pids, 1.0) == []
    finally:
        cleanup(pids)


# ------------------------------------------------------------------ random moments, real CLI

def finish_or_resend(proc: subprocess.Popen, number: int, trial: int) -> str:
    """stderr of ``proc`` once it ended after ``number``; a hang fails the test.

    One window is the interpreter's, not xlaunch's: Python 3.11 turns a KeyboardInterrupt raised
    while site.py imports an editable install's finder (pathlib -> ipaddress, in a __set_name__)
    into a RuntimeError that site.py reports as "Error processing line 1 of ...pth" and ignores,
    so the SIGINT is lost before xlaunch's code runs (CPython 3.12 no longer wraps it). Then the
    signal is sent again, as a user would press Ctrl-C again."""
    try:
        return proc.communicate(timeout=3)[1]
    except subprocess.TimeoutExpired as early:
        partial = early.stderr.decode(errors="replace") if isinstance(early.stderr, bytes) else early.stderr or ""
    if "Error processing line" in partial and "KeyboardInterrupt" in partial:
        proc.send_signal(number)
    try:
        return proc.communicate(timeout=17)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"trial {trial}: xlaunch hung after {signal.Signals(number).name}")
    raise AssertionError("unreachable")


def test_signals_at_random_moments_of_startup_never_hang(tmp_path) -> None:
    rng = random.Random(1234)
    program = tmp_path / "prog.py"
    program.write_text(RECORDER)
    leftovers: list[int] = []
    for trial in range(TRIALS):
        record = tmp_path / f"pids{trial}"
        number = rng.choice([signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
        proc = subprocess.Popen([sys.executable, "-m", "xlaunch", "--ninstances", str(INSTANCES),
                                 "--ncores-per-instance", "1", "--grace-period", "2", str(program), str(record)],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_signals)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(number)
        err = finish_or_resend(proc, number, trial)
        pids = recorded(record)
        leftovers += wait_gone(pids, 1.0)
        cleanup(pids)
        assert not traceback_in_xlaunch(err), err
        if python_still_starting(err):
            continue
        assert proc.returncode in (128 + number, -number), (trial, proc.returncode, err)
    assert leftovers == []


# ------------------------------------------------------------------ kill -9 of xlaunch

def test_kill_9_of_xlaunch_leaves_nothing_running(tmp_path) -> None:
    program = tmp_path / "stubborn.py"
    program.write_text(STUBBORN)
    record = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", "--ninstances", str(INSTANCES), "--ncores-per-instance",
                             "1", "--grace-period", "1", str(program), str(record)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    for _ in range(INSTANCES):
        assert b"ready" in proc.stdout.readline()
    pids = recorded(record)
    assert len(pids) == 2 * INSTANCES
    try:
        proc.kill()
        proc.wait(timeout=10)
        # SIGTERM is ignored by all four: the watchdog's SIGKILL after the 1 s grace period ends them
        assert wait_gone(pids, 6.0) == []
    finally:
        cleanup(pids)


def test_sigterm_needing_sigkill_exits_143(tmp_path) -> None:
    program = tmp_path / "stubborn.py"
    program.write_text(STUBBORN)
    record = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", "--grace-period", "0.5", str(program), str(record)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_signals)
    assert proc.stdout is not None
    assert b"ready" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=20)
    pids = recorded(record)
    try:
        assert proc.returncode == 143, err.decode()
        assert b"killed by SIGKILL (SIGTERM forwarded)" in err
        assert wait_gone(pids, 1.0) == []
    finally:
        cleanup(pids)


INTERRUPT_AT = """
import runpy, sys
def trace(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_name == {name!r} and code.co_filename.endswith({where!r}):
        sys.settrace(None)
        raise KeyboardInterrupt
sys.settrace(trace)
sys.argv = ["xlaunch", "--no-python", "true"]
runpy.run_module("xlaunch", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("name, where", [
    ("main", "xlaunch/launcher/__init__.py"), ("main", "xlaunch/launcher/cli/command.py"), ("run", "xlaunch/launcher/cli/command.py"),
    ("parse_fast", "xlaunch/launcher/cli/parse.py"), ("options_from", "xlaunch/launcher/cli/command.py"),
    ("load_machine", "xlaunch/machine/__init__.py"), ("plan", "xlaunch/launcher/plan/planner.py"),
    ("run_plan", "xlaunch/launcher/run/runner.py"),
])
def test_ctrl_c_at_each_step_before_the_runner(name: str, where: str) -> None:
    """A KeyboardInterrupt exactly at the entry of each function on the way to the runner (the
    moments a real Ctrl-C hits only by chance; CI once hit the entry of cli.main): exit 130."""
    done = subprocess.run([sys.executable, "-c", INTERRUPT_AT.format(name=name, where=where)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (130, ""), done.stderr


def test_ctrl_c_before_the_runner_is_exit_130_without_traceback(tmp_path) -> None:
    """SIGINT while xlaunch is still importing and planning: nothing started, no traceback."""
    program = tmp_path / "prog.py"
    program.write_text("open(__file__ + '.ran', 'w')\n")
    for delay in (0.01, 0.03, 0.06):
        proc = subprocess.Popen([sys.executable, "-m", "xlaunch", str(program)], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_signals)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=20)
        assert not traceback_in_xlaunch(err), err
        if python_still_starting(err):
            continue
        assert proc.returncode in (0, 130, -signal.SIGINT), err   # 0: the program had already finished


def test_sigint_ignored_at_start_stays_ignored_for_xlaunch_and_its_instances(tmp_path) -> None:
    """``nohup``/background-job semantics: an inherited SIG_IGN is respected, never half-forwarded."""
    program = tmp_path / "prog.py"
    program.write_text("import signal, time\n"
                       "print('ignored' if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 'default', flush=True)\n"
                       "time.sleep(2)\n")

    def ignore_sigint() -> None:
        default_signals()
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", str(program)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "[0] ignored\n"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "received SIGINT" not in err


SWALLOWED = """\
import os, signal, sys
from xlaunch.launcher import main, record_early_sigint
record_early_sigint()

class Dropped:
    def __del__(self):   # Python prints "Exception ignored in: ..." and drops the KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass

Dropped()
print("still running", flush=True)
sys.argv = ["xlaunch", "--ninstances", "1", "--ncores-per-instance", "1", sys.argv[1], sys.argv[2]]
main()
"""


def test_a_ctrl_c_python_dropped_during_startup_still_starts_nothing(tmp_path) -> None:
    """A Ctrl-C inside a ``__del__`` or weakref callback (importlib's module-lock callback, seen in
    CI), where Python would print a raised KeyboardInterrupt and drop it, is recorded without a
    traceback, and the record still stops the launch."""
    record = tmp_path / "pids"
    program = tmp_path / "prog.py"
    program.write_text(RECORDER)
    script = tmp_path / "dropped.py"
    script.write_text(SWALLOWED)
    done = subprocess.run([sys.executable, str(script), str(program), str(record)], cwd=REPO,
                          capture_output=True, text=True, timeout=30, preexec_fn=default_signals)
    assert "still running" in done.stdout                       # the program went on past the __del__
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    assert recorded(record) == []                               # no instance started
    assert "not started (SIGINT received)" in done.stderr, done.stderr


def frame_of(name: str, filename: str) -> object:
    namespace = {"sys": sys}
    exec(compile(f"def {name}():\n    return sys._getframe()\n", filename, "exec"), namespace)
    return namespace[name]()


def test_only_frames_under_a_callback_python_drops_exceptions_from_are_spared_the_raise() -> None:
    from xlaunch.launcher import raise_would_be_dropped

    assert raise_would_be_dropped(frame_of("cb", "<frozen importlib._bootstrap>"))
    assert raise_would_be_dropped(frame_of("_remove", "/usr/lib/python3.11/_weakrefset.py"))
    assert not raise_would_be_dropped(frame_of("cb", "/work/app/callbacks.py"))
    assert not raise_would_be_dropped(sys._getframe())
    assert not raise_would_be_dropped(None)

    def helper() -> bool:
        return raise_would_be_dropped(sys._getframe())

    class Finalized:
        def __del__(self) -> None:
            seen.append(raise_would_be_dropped(sys._getframe()))
            seen.append(helper())   # a function the __del__ calls: its raise would unwind into it

    seen: list[bool] = []
    Finalized()
    assert seen == [True, True] and not helper()
