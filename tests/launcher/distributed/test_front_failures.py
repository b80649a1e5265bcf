"""The exit status of a ``--nproc-per-node`` job whose rank fails, and Ctrl-C while torch's agent starts.

The front stops the other ranks (SIGTERM) the moment it sees one fail; torch's agent may then find
them all ended in one poll. The job's status must still be the first failed rank's own (1, 3,
139 for SIGSEGV), as the single-node runner reports it, with and without ``--log-dir``, and
torch's "Root Cause" must name that rank. A SIGINT before the ranks run ends the job with one
clean line per event: no ``KeyboardInterrupt`` traceback from the agent, status 130, nothing left.
"""
from __future__ import annotations

import importlib.util
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from processes import leftovers, running, wait_gone

pytestmark = pytest.mark.live
if importlib.util.find_spec("torch") is None:     # found without importing it here
    pytest.skip("needs torch (torch's elastic agent)", allow_module_level=True)
if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 allowed CPUs (2 ranks)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[3]

# a torch-free rank: rank 1 fails as told once rank 0 has printed its line (rank 0 marks it with a file
# named after the job: on a loaded machine rank 0's Python may start later than rank 1's), and a moment
# later (the front has read both lines); rank 0 (every rank with "wait") waits to be stopped;
# "grandchild" leaves a child of rank 1 holding its output pipe
RANK = """\
import os, pathlib, signal, subprocess, sys, time
rank = int(os.environ["LOCAL_RANK"])
how = sys.argv[1]
printed = pathlib.Path(sys.argv[0]).with_name(f"rank0-printed-{how}")
print(f"ready {rank} {os.getpid()}", flush=True)
if rank == 0:
    printed.touch()
if rank != 1 or how == "wait":
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        sys.exit(130)
deadline = time.monotonic() + 60
while not printed.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)
if how == "grandchild":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"grandchild {child.pid}", flush=True)
    sys.exit(1)
if how == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
sys.exit(int(how))
"""


def job_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def default_signals() -> None:
    """SIGINT at its default in xlaunch, whatever the test runner inherited (a background job's
    ignored SIGINT would stay ignored)."""
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)


def start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xlaunch", "--nproc-per-node", "2", "--grace-period", "2", *argv],
                            env=job_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)






def wait_for_agent(job: subprocess.Popen, timeout: float = 60) -> int:
    """The pid of torch's agent once xlaunch has started it (its own command line is running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        try:
            for child in psutil.Process(job.pid).children():
                if "xlaunch.launcher.distributed.agent" in " ".join(child.cmdline()):
                    return child.pid
        except psutil.Error:
            pass
        time.sleep(0.01)
    raise AssertionError(f"no agent started (xlaunch: {job.poll()})")


def root_cause_rank(stderr: str) -> str | None:
    """The rank torch's "Root Cause" section names (None if this torch prints none)."""
    section = stderr.partition("Root Cause")[2]
    found = re.search(r"local_rank: (\d+)\)", section)
    return found.group(1) if found else None


# Exit 1 is the grandchild's job (rank 1 exits 1 there, leaving a child of its own holding its output
# pipe): a job of its own for a plain exit 1 would only repeat the exit 3 one with another number.
CASES = {"3": 3, "segv": 128 + signal.SIGSEGV, "grandchild": 1}


# --log-dir only adds a file beside the console for each rank's output (the front's status path is
# the same): the plain exit runs without it, the rank that dies and the one that leaves a grandchild
# with it. (Each job starts torch's agent, ~4 s of CPU: the cases did run twice, with and without.)
LOG_DIR = {"3": False, "segv": True, "grandchild": True}


def test_the_job_ends_with_the_first_failed_ranks_status(tmp_path: Path) -> None:
    """Rank 1 fails on its own (exit 3, SIGSEGV, exit 1 leaving a grandchild); rank 0 is stopped by
    xlaunch (SIGTERM: 143), which must not be the job's status. The three jobs run at once, two of
    them with ``--log-dir``."""
    program = tmp_path / f"xlaunch_rank_{uuid.uuid4().hex}.py"
    program.write_text(RANK)
    jobs = {how: start(*(["--log-dir", str(tmp_path / how)] if LOG_DIR[how] else []), str(program), how)
            for how in CASES}
    try:
        done = {how: job.communicate(timeout=180) for how, job in jobs.items()}
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    pids = []
    for how, (out, err) in done.items():
        expected = CASES[how]
        assert jobs[how].returncode == expected, (how, err)
        assert f"xlaunch: exit status {expected}\n" in err, (how, err)
        shown = "killed by SIGSEGV" if how == "segv" else f"exit {expected}"
        assert re.search(rf"^xlaunch: 1 +\S+ +{shown} ", err, re.M), (how, err)      # rank 1's summary row
        assert re.search(r"^xlaunch: 0 +\S+ +killed by SIGTERM \(stopped after rank 1 failed\)", err, re.M), (how, err)
        assert root_cause_rank(err) in (None, "1"), (how, err)      # torch's "Root Cause" section
        found = [int(p) for p in re.findall(r"(?:ready \d|grandchild) (\d+)", out)]
        assert len(found) == (3 if how == "grandchild" else 2), (how, out)     # on the console, log-dir or not
        pids += found
        if LOG_DIR[how]:
            assert (tmp_path / how / "xlaunch_rank_1.log").read_text().startswith("ready 1 ")
    assert wait_gone(pids, 5) == []
    assert leftovers(program.name) == []


def test_sigint_while_the_agent_starts_is_one_clean_line(tmp_path: Path) -> None:
    """SIGINT at several moments after xlaunch started torch's agent (at once: the agent's Python is
    starting; later: it imports torch or meets in its rendezvous; on a fast machine its ranks may
    run by then): no traceback from the agent, status 130, and nothing of the job left."""
    program = tmp_path / f"xlaunch_rank_{uuid.uuid4().hex}.py"
    program.write_text(RANK)
    for delay in (0.0, 1.0, 2.5):
        job = start(str(program), "wait")
        try:
            agent = wait_for_agent(job)
            time.sleep(delay)
            job.send_signal(signal.SIGINT)
            out, err = job.communicate(timeout=60)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        assert job.returncode == 128 + signal.SIGINT, (delay, err)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        assert "xlaunch: received SIGINT" in err, (delay, err)
        if delay == 0.0:                 # the agent had to start Python and import torch first
            assert re.findall(r"^xlaunch: [01] +\S+ +not started", err, re.M) != [], err
        assert running([agent]) == [] and leftovers(program.name) == [], delay


def test_the_root_cause_is_the_rank_that_failed_on_its_own(tmp_path: Path) -> None:
    """torch's own choice on a tie (same second) is the lowest rank, here one stopped by SIGTERM (or by
    SIGKILL after ignoring it); the agent's is the rank the front noted, unless that one was itself
    killed by SIGTERM, else one that failed on its own."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from xlaunch.launcher.distributed.agent import root_cause

    def failure(rank: int, exitcode: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")

    def first(failed: ChildFailedError, noted: int | None) -> int:
        note = tmp_path / "note.json"
        note.write_text("{}" if noted is None else f'{{"pid": {1000 + noted}}}')
        chosen = root_cause(failed, str(note))
        assert chosen.failures.keys() == failed.failures.keys()
        rank = chosen.get_first_failure()[0]
        assert "Root Cause" in chosen.format_msg() and f"local_rank: {rank})" in \
            chosen.format_msg().partition("Root Cause")[2]
        return rank

    stopped = ChildFailedError("job", {0: failure(0, -signal.SIGTERM), 1: failure(1, 1), 2: failure(2, -signal.SIGTERM)})
    stopped.failures[1].timestamp = stopped.failures[0].timestamp = stopped.failures[2].timestamp
    assert stopped.get_first_failure()[0] == 0                 # torch's own pick
    assert [first(stopped, noted) for noted in (None, 0, 1, 2)] == [1, 1, 1, 1]
    # rank 0 ignored the SIGTERM and was killed after the grace period, in the second rank 1 exited 3
    escalated = ChildFailedError("job", {0: failure(0, -signal.SIGKILL), 1: failure(1, 3)})
    escalated.failures[1].timestamp = escalated.failures[0].timestamp
    assert escalated.get_first_failure()[0] == 0 and [first(escalated, noted) for noted in (None, 1)] == [1, 1]
    oom = ChildFailedError("job", {0: failure(0, -signal.SIGTERM), 1: failure(1, -signal.SIGKILL)})
    oom.failures[1].timestamp = oom.failures[0].timestamp
    assert first(oom, None) == 1                                # a SIGKILL alone (OOM) is still the cause
    both = ChildFailedError("job", {0: failure(0, 2), 1: failure(1, -signal.SIGSEGV)})
    both.failures[1].timestamp = both.failures[0].timestamp
    assert [first(both, noted) for noted in (None, 0, 1)] == [0, 0, 1]


# attempt 0: rank 1 fails (exit 3) once rank 0 runs, rank 0 waits to be stopped; attempt 1: both succeed
RESTARTED = """\
import os, pathlib, sys, time
rank, attempt = int(os.environ["LOCAL_RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
started = pathlib.Path(sys.argv[1])
print(f"rank {rank} attempt {attempt}", flush=True)
if attempt != "0":
    sys.exit(0)
if rank == 0:
    started.touch()
    time.sleep(60)
deadline = time.monotonic() + 60
while not started.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_restarted_job_says_how_each_earlier_attempt_ended(tmp_path: Path) -> None:
    """With --max-restarts the summary's rows are the last attempt's: the earlier ones are said before them
    (a job that succeeded on its second attempt read as if nothing had failed) and kept in --summary-json."""
    script, summary = tmp_path / "rank.py", tmp_path / "summary.json"
    script.write_text(RESTARTED)
    job = start("--max-restarts", "1", "--summary-json", str(summary), str(script), str(tmp_path / "started"))
    _out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    lines = [line for line in err.splitlines() if line.startswith("xlaunch: attempt ")]
    assert lines == ["xlaunch: attempt 1 of 2 (torch's agent restarted the ranks): rank 0 killed by SIGTERM "
                     "(stopped after rank 1 failed), rank 1 exit 3"], err
    import json

    earlier = json.loads(summary.read_text())["distributed"]["earlier_attempts"]
    assert [(e["attempt"], e["rank"], e["exit_code"]) for e in earlier] == [(1, 0, 143), (1, 1, 3)]


# every rank exits 3 at the same moment: each waits for the other's file, then for the next 0.2 s tick
AT_ONCE = """\
import os, pathlib, sys, time
rank = int(os.environ["LOCAL_RANK"])
folder = pathlib.Path(sys.argv[1])
(folder / f"rank{rank}").touch()
deadline = time.monotonic() + 60
while len(list(folder.glob("rank*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.002)
time.sleep(0.3 - time.time() % 0.2)
os._exit(3)
"""


def test_ranks_failing_at_the_same_moment_are_not_said_to_be_stopped(tmp_path: Path) -> None:
    """Two ranks exit 3 at once: a rank's row says 'exit 3' (it failed on its own), never 'exit 3 (stopped
    after rank N failed)'; a rank xlaunch's SIGTERM reached first is 'killed by SIGTERM (stopped ...)'. The
    agent's stop and xlaunch's race here: whatever the order, the job's status is 3."""
    program = tmp_path / f"xlaunch_rank_{uuid.uuid4().hex}.py"
    program.write_text(AT_ONCE)
    job = start(str(program), str(tmp_path))
    _out, err = job.communicate(timeout=120)
    assert job.returncode == 3, err
    rows = re.findall(r"^xlaunch: ([01]) +\S+ +(.+?)  ", err, re.M)
    assert len(rows) == 2 and any(status == "exit 3" for _rank, status in rows), err
    assert all(status in ("exit 3", "killed by SIGTERM (stopped after rank 0 failed)",
                          "killed by SIGTERM (stopped after rank 1 failed)") for _rank, status in rows), err
    assert leftovers(program.name) == []
