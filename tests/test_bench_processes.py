"""The launches the multi-process benches time are stopped with everything under them: at a run's
time limit, and when the bench itself gets SIGTERM. torch's run_cpu and torchrun start their
programs in sessions of their own and leave them running when they are killed; the fake launcher
here does the same."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from bench_modules import BENCH, load

# a launcher as run_cpu/torchrun are: its program in a session of its own, both long-running
LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
with open(os.environ["PIDFILE"] + ".tmp", "w") as handle:
    handle.write(str(child.pid))
os.replace(os.environ["PIDFILE"] + ".tmp", os.environ["PIDFILE"])
print("launched", flush=True)
time.sleep(120)
"""

DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import _processes
import distributed
distributed.Config.command = lambda self, train: [sys.executable, sys.argv[2]]
_processes.exit_on_sigterm()
distributed.run_once(distributed.Config("torchrun", 2, 1), [], 120)
"""


def gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def wait_for(path: Path, within: float = 60.0) -> int:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


def test_a_timed_out_run_stops_the_program_in_its_own_session_and_removes_its_scratch(
        tmp_path: Path, monkeypatch) -> None:
    """bench/throughput.py killed run_cpu alone at --timeout: its infer.py ran on, an orphan."""
    throughput = load("throughput")
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    monkeypatch.setattr(throughput, "INFER", str(launcher))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    env = {**os.environ, "PIDFILE": str(tmp_path / "pid")}
    record = throughput.run_once(throughput.Config("plain", 1, 1), [], 1.0, 2.0, env)
    program = wait_for(tmp_path / "pid", within=0)
    assert record["status"] == "timeout" and "launched" in record["error"], record
    assert gone(program), "the launcher's program outlived the run's time limit"
    assert list(scratch.iterdir()) == []


def test_bench_tune_stops_a_program_outside_the_launchers_group(tmp_path: Path, monkeypatch, capsys) -> None:
    """bench/tune.py signalled the launch's process group: run_cpu's program, in a session of its own,
    ran on after the time limit (holding the output pipe the bench then waited on)."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    monkeypatch.setenv("PIDFILE", str(tmp_path / "pid"))
    tune, started = load("tune"), time.monotonic()
    assert tune.run_once("run_cpu default", [sys.executable, str(launcher)], 1, 2.0, grace=2.0) is None
    assert time.monotonic() - started < 30, "the bench waited for the program it left running"
    assert capsys.readouterr().out == "  run_cpu default: timed out after 2s\n"
    assert gone(wait_for(tmp_path / "pid", within=0))


def test_sigterm_of_the_bench_stops_the_launch_it_was_timing(tmp_path: Path) -> None:
    """bench/distributed.py ended by SIGTERM left torchrun and its ranks running."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    env = {**os.environ, "PIDFILE": str(tmp_path / "pid")}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(BENCH), str(launcher)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        program = wait_for(tmp_path / "pid")
        launched = psutil.Process(driver.pid).children()
        driver.send_signal(signal.SIGTERM)
        out, err = driver.communicate(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 128 + signal.SIGTERM, (out, err)
    assert err.strip().splitlines() == ["-c: terminated, stopping what it started"], err
    assert gone(program) and all(gone(p.pid) for p in launched)


# the first of the slots' runs to start ends at once; the others decode "for ever"
SLOT = """
import os, sys, time
try:
    os.mkdir(sys.argv[1] + "/first")
    print("done", flush=True)
except FileExistsError:
    with open(f"{sys.argv[1]}/slow-{os.getpid()}", "w"):
        pass
    time.sleep(120)
"""


def test_an_interrupted_llama_window_stops_the_slots_still_running(tmp_path: Path) -> None:
    """bench/llm.py --instances: a Ctrl-C or SIGTERM during llama.cpp's window left the other llama-bench
    processes running."""
    load("llm")                                          # bench/ on sys.path
    llamacpp = load("_llamacpp")
    cpu = sorted(os.sched_getaffinity(0))[0]
    script = tmp_path / "slot.py"
    script.write_text(SLOT)

    def parse(text: str) -> list:
        while not list(tmp_path.glob("slow-*")):        # the other slot is running
            time.sleep(0.02)
        raise KeyboardInterrupt

    try:
        llamacpp.run_slots([sys.executable, str(script), str(tmp_path)], [[cpu], [cpu]], 2, parse)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interruption was swallowed")
    (slow,) = tmp_path.glob("slow-*")
    assert gone(int(slow.name.split("-")[1]), within=0.5), "a llama-bench slot outlived the interrupted window"


def test_an_interrupted_pair_stops_the_xlaunch_copies(monkeypatch) -> None:
    """bench/llm.py --instances ended by SIGTERM mid-window: xlaunch and its copies decoded on, for ever
    (they wait for the bench's files), each at a full core."""
    inst = load("_llm_instances")
    stopped = []

    class Copies:
        def __init__(self, *args: object) -> None:
            pass

        def window(self, rounds: int) -> dict:
            raise SystemExit(143)                          # what the bench's SIGTERM raises

        def stop(self) -> None:
            stopped.append(True)

    monkeypatch.setattr(inst, "XlaunchInstances", Copies)
    args = type("Args", (), {"rounds": 2, "new_tokens": 8, "prompt": 4})()
    try:
        inst.run_pair(args, "xlaunch-int8", None, {"xlaunch-int8": Path("x.xlp")}, None, 1, 1, [[0]], "llm.py", {},
                      lambda values: None, None)
    except SystemExit:
        pass
    assert stopped == [True]


SETTING_UP = """
import os, sys, time
with open(os.environ["PIDFILE"] + ".tmp", "w") as handle:
    handle.write(str(os.getpid()))
os.replace(os.environ["PIDFILE"] + ".tmp", os.environ["PIDFILE"])
time.sleep(120)                # a route loading or compiling: it reads no stdin, so never sees the bench gone
"""


def test_an_interrupted_bench_stops_the_workers_it_started(tmp_path: Path, monkeypatch) -> None:
    """bench/llm.py interrupted (Ctrl-C, SIGTERM) while a torch route set up: the worker loaded or compiled on,
    orphaned, until it found its stdout closed."""
    import argparse

    load("llm")                                          # bench/ on sys.path
    rounds = load("_llm_rounds")
    script = tmp_path / "worker.py"
    script.write_text(SETTING_UP)
    monkeypatch.setenv("PIDFILE", str(tmp_path / "pid"))
    monkeypatch.setattr(rounds, "SCRIPT", str(script))

    def answer(self) -> dict:
        wait_for(tmp_path / "pid")
        raise KeyboardInterrupt

    monkeypatch.setattr(rounds.Worker, "answer", answer)
    args = argparse.Namespace(route_names=["hf-fp32"], isa=None, prompt=1, new_tokens=2, batch=1, load="checkpoint",
                              rounds=1, lock="")
    try:
        rounds.run_threads(1, args, tmp_path, None)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interruption was swallowed")
    assert gone(int((tmp_path / "pid").read_text()), within=0.5), "the worker outlived the interrupted bench"


def test_an_interrupted_streams_bench_stops_its_workers_mid_window(tmp_path: Path, monkeypatch) -> None:
    """bench/streams.py interrupted (SIGTERM had no handler; Ctrl-C asked each worker to quit and waited for it):
    the workers ran their window, warm-up or --seconds long, orphaned."""
    streams = load("streams")
    script = tmp_path / "worker.py"
    script.write_text(SETTING_UP)
    monkeypatch.setenv("PIDFILE", str(tmp_path / "pid"))
    started = time.monotonic()
    try:
        with streams.workers_closed() as workers:       # the worker is "mid-window": it reads no stdin
            workers["plain"] = [streams.Worker("plain", 2, [0], dict(os.environ), [sys.executable, str(script)])]
            wait_for(tmp_path / "pid")
            raise SystemExit(143)                          # what the bench's SIGTERM raises
    except SystemExit:
        pass
    assert gone(int((tmp_path / "pid").read_text()), within=0.5), "the worker outlived the interrupted bench"
    assert time.monotonic() - started < 15


def test_the_streams_summary_has_no_nan_where_no_rep_was_clean() -> None:
    """On a busy machine no rep is 'clean': the summary printed 'clean median nan' and 'clean nan' ratios."""
    streams = load("streams")
    results = {"streams": [120.0, 100.0], "procs": [100.0, 80.0]}
    foreign = {"streams": [0.5, 0.02], "procs": [0.5, 0.6]}
    lines = [" ".join(line.split()) for line in streams.summary(["streams", "procs"], results, foreign, 0.05)]
    assert lines == [
        "streams median 110.0 img/s clean median 100.0 (1/2 reps) best 120.0 others' CPU share median 26%",
        "procs median 90.0 img/s clean median - (0/2 reps) best 100.0 others' CPU share median 55%",
        "ratio streams/procs: median 1.222 clean - best 1.200"]


CLOSED_STDOUT = """
import sys
sys.path.insert(0, sys.argv[1])
import _processes
_processes.survive_closed_stdout()
for line in range(20000):
    print("a row of the bench's table " * 4, flush=line % 100 == 0)
with open(sys.argv[2], "w") as handle:        # what --json writes at the end
    handle.write("written")
"""


def test_a_closed_stdout_does_not_end_the_run(tmp_path: Path) -> None:
    """bench/throughput.py --json out.json | head: the bench died of BrokenPipeError at the first line past
    head's and wrote no JSON."""
    reader = subprocess.Popen(["head", "-c", "10"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    bench = subprocess.run([sys.executable, "-c", CLOSED_STDOUT, str(BENCH), str(tmp_path / "out.json")],
                           stdout=reader.stdin, stderr=subprocess.PIPE, text=True, timeout=60)
    reader.stdin.close()
    reader.wait()
    assert bench.returncode == 0, bench.stderr
    assert (tmp_path / "out.json").read_text() == "written"
    assert bench.stderr.splitlines() == ["-c: stdout failed (Broken pipe); the run goes on without it (--json, if "
                                         "given, is still written)"], bench.stderr
