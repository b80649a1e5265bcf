"""Distributed jobs on this machine, loopback only: DDP (gloo) through ``xlaunch --nproc-per-node``,
under a plain torchrun with ``--no-python xlaunch --per-rank``, two "nodes" on 127.0.0.1, a failing
rank, SIGTERM, SIGKILL of the front, a script that sets its own MASTER_ADDR/MASTER_PORT. Each rank's
CPUs are read back from /proc; what is left running is looked for in /proc and with psutil."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from host_cpus import need_cpus
from processes import free_port, leftovers, running, wait_gone

from xlaunch.cpulist import format_cpulist, parse_cpulist

pytestmark = pytest.mark.live
if importlib.util.find_spec("torch") is None:     # found without importing it here
    pytest.skip("needs torch", allow_module_level=True)

REPO = Path(__file__).resolve().parents[3]
TRAIN = str(REPO / "examples" / "train.py")
if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 allowed CPUs", allow_module_level=True)

# a torch-free rank: reports where it runs (print() under PYTHONUNBUFFERED=1: text and newline are two
# writes), then fails, exits or waits as told; with "stubborn" it and a child of its ignore SIGTERM
RANK_PROGRAM = """\
import os, signal, subprocess, sys, time
rank = int(os.environ["LOCAL_RANK"])
cpus = [l.split(":", 1)[1].strip() for l in open("/proc/self/status") if l.startswith("Cpus_allowed_list")][0]
child = None
if "stubborn" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(120)"])
print(f"ready {rank} cpus {cpus} ppid {os.getppid()} omp {os.environ.get('OMP_NUM_THREADS')} "
      f"rank {os.environ['RANK']} world {os.environ['WORLD_SIZE']} pid {os.getpid()} "
      f"child {child.pid if child else 0}", flush=True)
for i in range(int(os.environ.get("LINES", "0"))):
    print(f"line {rank} {i}", flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)
if rank == int(sys.argv[1]):
    time.sleep(float(sys.argv[2]))
    sys.exit(3)
time.sleep(120)
"""


def loopback() -> list[str]:
    """Rendezvous on 127.0.0.1 at a free port (torch's static rendezvous, node 0 of 1)."""
    return ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def job_env() -> dict[str, str]:
    """A clean environment: no thread settings of ours, gloo on the loopback interface."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def xlaunch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "xlaunch", *argv]


def planned_ranks(*argv: str) -> list[dict]:
    """Each planned rank (``cpus``, ``env``), from the front's own --dry-run --json."""
    out = subprocess.run(xlaunch(*argv[:-1], "--dry-run", "--json", argv[-1]), env=job_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)["instances"]


def slices(*argv: str) -> list[str]:
    """The CPUs of each planned rank, as a cpulist."""
    return [format_cpulist(i["cpus"]) for i in planned_ranks(*argv)]


DDP_LINE = re.compile(r"ddp rank (\d+) world (\d+) local_rank (\d+) cpus (\S+) threads (\d+) "
                      r"steps/s \S+ checksum (-?[0-9.]+)")


def ddp_lines(output: str) -> dict[int, dict[str, str]]:
    """The ``ddp rank ...`` reports by rank (found anywhere: under a plain torchrun, ``python -u``
    ranks share one pipe and may write a line's text and its newline apart)."""
    names = ("rank", "world", "local_rank", "cpus", "threads", "checksum")
    return {int(m.group(1)): dict(zip(names, m.groups())) for m in DDP_LINE.finditer(output)}




def check_ddp(output: str, ranks: list[dict], world: int = 2) -> None:
    lines = ddp_lines(output)
    assert sorted(lines) == list(range(world)), output
    assert {v["world"] for v in lines.values()} == {str(world)}
    assert len({v["checksum"] for v in lines.values()}) == 1, output      # gradients were averaged
    for rank, fields in lines.items():
        planned = ranks[int(fields["local_rank"])]
        # examples/train.py reads its CPUs before importing torch (GNU OpenMP's OMP_PROC_BIND then
        # narrows the main thread to its first place): the rank's whole slice
        assert fields["cpus"] == format_cpulist(planned["cpus"]), (rank, fields, planned["cpus"])
        assert fields["threads"] == str(len(planned["cpus"]))


# examples/train.py, started by a script that first sets its own MASTER_ADDR/MASTER_PORT as IPEX's DDP
# test scripts do (after printing what the front gave it): under plain torchrun such a script waits
# for the agent's store at its own port (30 min); under the front rank 0 hosts the store there.
OWN_MASTER_TRAIN = """\
import os, runpy, sys
print(f"front gave {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}", flush=True)
os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = sys.argv.pop(1)
sys.argv[0] = sys.argv.pop(1)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_front_trains_ddp_with_each_rank_on_its_slice_and_the_scripts_own_master_address(tmp_path: Path) -> None:
    """One DDP job (each rank imports torch: seconds of CPU) for both: the ranks train on their
    slices, and the script's own MASTER_ADDR/MASTER_PORT (not the front's) is where they meet.
    Given in ipexrun's spelling (--nprocs_per_node), whose note is printed once."""
    program = tmp_path / "own_master_train.py"
    program.write_text(OWN_MASTER_TRAIN)
    port, own_port = str(free_port()), str(free_port())
    argv = ("--nprocs_per_node", "2", "--master-addr", "127.0.0.1", "--master-port", port, str(program))
    expected = planned_ranks(*argv)
    assert len(expected) == 2 and not set(expected[0]["cpus"]) & set(expected[1]["cpus"])
    done = subprocess.run(xlaunch(*argv, own_port, TRAIN, "--ddp", "--steps", "2"), env=job_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("xlaunch: note: --nprocs_per_node (ipexrun") == 1, done.stderr
    check_ddp(done.stdout, expected)
    gave = sorted((index, text) for index, text in prefixed(done.stdout) if text.startswith("front gave "))
    assert gave == [(0, f"front gave 127.0.0.1:{port}"), (1, f"front gave 127.0.0.1:{port}")], done.stdout


# A torch-free rank for the plain torchrun: what ``xlaunch --per-rank`` left it (its CPUs, threads, the
# variables the process group is made from, its parent), in one write (ranks share torchrun's pipe).
# The DDP training itself is the front's test above: under --per-rank each rank is torchrun's own
# worker, exec'd, with torchrun's variables passed through.
PER_RANK_PROGRAM = """\
import os
cpus = [l.split(":", 1)[1].strip() for l in open("/proc/self/status") if l.startswith("Cpus_allowed_list")][0]
e = os.environ
os.write(1, (f"per-rank local_rank {e['LOCAL_RANK']} rank {e['RANK']} world {e['WORLD_SIZE']} cpus {cpus} "
             f"omp {e.get('OMP_NUM_THREADS')} master {e.get('MASTER_ADDR')}:{e.get('MASTER_PORT')} "
             f"run {e.get('TORCHELASTIC_RUN_ID')} ppid {os.getppid()} pid {os.getpid()}\\n").encode())
"""
PER_RANK_LINE = re.compile(r"per-rank local_rank (\d+) rank (\d+) world (\d+) cpus (\S+) omp (\S+) master (\S+) "
                           r"run (\S+) ppid (\d+) pid (\d+)\n")


def test_plain_torchrun_with_per_rank_ranks(tmp_path: Path) -> None:
    """``torchrun --no-python xlaunch --per-rank PROGRAM``: each of torchrun's workers becomes PROGRAM
    (exec'd: torchrun's agent is its parent) on its own slice of the front's plan, with one thread per
    CPU of it (torchrun's default of 1 dropped) and torchrun's process-group variables as they were."""
    # an ``xlaunch`` command of this checkout, found on PATH as a user's would be (through sh, as pip writes
    # a console script whose interpreter path has a space: a #! line ends at the first one)
    script = tmp_path / "xlaunch"
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m xlaunch \"$@\"\n")
    script.chmod(0o755)
    program = tmp_path / "rank.py"
    program.write_text(PER_RANK_PROGRAM)
    env = job_env()
    env["PATH"] = f"{tmp_path}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    need_cpus(2)                                # a slice of its own for each rank
    expected = planned_ranks("--nproc-per-node", "2", str(program))
    assert len(expected) == 2 and not set(expected[0]["cpus"]) & set(expected[1]["cpus"])
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--no-python", "xlaunch", "--per-rank",
               str(program)]
    torchrun = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = torchrun.communicate(timeout=120)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
    assert torchrun.returncode == 0, err
    names = ("local_rank", "rank", "world", "cpus", "omp", "master", "run", "ppid", "pid")
    ranks = {int(m.group(1)): dict(zip(names, m.groups())) for m in PER_RANK_LINE.finditer(out)}
    assert sorted(ranks) == [0, 1], out
    for local, fields in ranks.items():
        planned = expected[local]
        assert fields["rank"] == str(local) and fields["world"] == "2", fields
        assert fields["cpus"] == format_cpulist(planned["cpus"]), (fields, planned["cpus"])
        assert fields["omp"] == str(len(planned["cpus"])), fields        # not torchrun's 1
    # one rendezvous for both (where DDP's process group would meet), and both are torchrun's own workers
    assert len({(f["master"], f["run"]) for f in ranks.values()}) == 1, ranks
    assert ranks[0]["master"].rsplit(":", 1)[1].isdigit() and ranks[0]["run"] != "None", ranks
    assert {int(f["ppid"]) for f in ranks.values()} == {torchrun.pid}, ranks     # exec'd, no process between
    assert wait_gone([int(f["pid"]) for f in ranks.values()], 2.0) == []


def prefixed(output: str) -> list[tuple[int, str]]:
    """``[i] text`` console lines as (i, text); anything else is not a rank's line."""
    found = []
    for line in output.splitlines():
        head, _, text = line.partition("] ")
        if head.startswith("[") and head[1:].isdigit():
            found.append((int(head[1:]), text))
    return found


def ready_fields(output: str) -> dict[int, list[str]]:
    """Each rank's ``ready`` report (fields: ready L cpus C ppid P omp T rank R world W pid X child Y)."""
    return {index: text.split() for index, text in prefixed(output) if text.startswith("ready ")}


def job_pids(ready: dict[int, list[str]]) -> list[int]:
    return [int(f[13]) for f in ready.values()] + [int(f[15]) for f in ready.values() if f[15] != "0"]






def test_two_nodes_on_loopback_reach_world_size_two(tmp_path: Path) -> None:
    """Two fronts rendezvous on 127.0.0.1 (torch's static rendezvous): each rank is told world 2."""
    program, token = _rank_program(tmp_path)
    port = str(free_port())
    cpus = sorted(os.sched_getaffinity(0))
    nodes = []
    for node in (0, 1):
        nodes.append(subprocess.Popen(
            xlaunch("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                    "--master-port", port, "--cores-list", str(cpus[node]), program, "exit"),
            env=job_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in nodes:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs.append(out)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ready = [ready_fields(out) for out in outputs]
    assert [list(r) for r in ready] == [[0], [0]], outputs
    assert [(r[0][3], r[0][9], r[0][11]) for r in ready] == [(str(cpus[0]), "0", "2"), (str(cpus[1]), "1", "2")]
    assert leftovers(token) == []


def _rank_program(tmp_path: Path) -> tuple[str, str]:
    token = f"xlaunch_rank_{uuid.uuid4().hex}.py"
    path = tmp_path / token
    path.write_text(RANK_PROGRAM)
    return str(path), token


def test_failing_rank_stops_the_others_within_the_grace_period(tmp_path: Path) -> None:
    """Rank 1 exits 3 after 1 s; rank 0 and its child ignore SIGTERM: SIGKILL 2 s later (torch's
    agent alone waited 30 s). Each rank's 300 print() lines arrive whole under its own prefix,
    in its own log, and in a per-rank --summary-json."""
    program, token = _rank_program(tmp_path)
    expected = slices("--nproc-per-node", "2", program)
    summary, logs, scratch = tmp_path / "summary.json", tmp_path / "logs", tmp_path / "tmp"
    scratch.mkdir()
    env = {**job_env(), "LINES": "300", "TMPDIR": str(scratch)}
    done = subprocess.run(xlaunch("--nproc-per-node", "2", *loopback(), "--grace-period", "2", "--log-dir", str(logs),
                                  "--log-file-prefix", "job", "--summary-json", str(summary), program, "1", "1",
                                  "stubborn"),
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=100)
    assert done.returncode == 3, done.stderr
    ready = ready_fields(done.stdout)
    assert [(r[1], r[3]) for r in (ready[0], ready[1])] == [("0", expected[0]), ("1", expected[1])], done.stdout
    # OMP_NUM_THREADS: the slice's size, not torchrun's 1
    assert [ready[rank][7] for rank in (0, 1)] == [str(len(parse_cpulist(cpus))) for cpus in expected]
    assert ready[0][5] == ready[1][5]                        # both ranks are children of the same agent (exec'd)
    for rank in (0, 1):                                      # whole lines, each under its own rank's prefix
        lines = [text for index, text in prefixed(done.stdout) if index == rank and not text.startswith("ready ")]
        assert lines == [f"line {rank} {i}" for i in range(300)], done.stdout[-2000:]
        log = (logs / f"job_rank_{rank}.log").read_text().splitlines()
        assert log[1:] == lines and log[0].startswith(f"ready {rank} ")
    assert (logs / "job_launcher.log").is_file()
    ranks = {r["index"]: r for r in json.loads(summary.read_text())["instances"]}
    assert ranks[1]["status"] == "exit 3" and ranks[1]["exit_code"] == 3
    assert ranks[0]["status"] == "killed by SIGKILL (stopped after rank 1 failed)", ranks
    assert ranks[0]["wall_s"] < 1 + 2 + 3.0                  # failure after 1 s, SIGKILL 2 s later (+ slack)
    assert wait_gone(job_pids(ready), 2.0) == []
    assert leftovers(token) == []
    assert os.listdir(scratch) == []     # torch's agent left a torchelastic_* tree there for every job


def wait_ready(job: subprocess.Popen, count: int, timeout: float = 60) -> dict[int, list[str]]:
    """Read the job's stdout until ``count`` ranks printed their ``ready`` line."""
    ready: dict[int, list[str]] = {}
    selector = selectors.DefaultSelector()
    selector.register(job.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buffer = b""
    while len(ready) < count and time.monotonic() < deadline:
        if selector.select(timeout=1):
            chunk = os.read(job.stdout.fileno(), 4096)
            if not chunk:
                break
            buffer += chunk
            ready = ready_fields(buffer.decode(errors="replace"))
    selector.close()
    assert len(ready) == count, (buffer, job.poll())
    return ready


def test_sigterm_mid_run_stops_stubborn_ranks_within_the_grace_period(tmp_path: Path) -> None:
    program, token = _rank_program(tmp_path)
    job = subprocess.Popen(xlaunch("--nproc-per-node", "2", *loopback(), "--grace-period", "1", program, "-1", "0",
                                   "stubborn"),
                           env=job_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready = wait_ready(job, 2)
        agent = {int(f[5]) for f in ready.values()}
        assert len(agent) == 1 and psutil.Process(agent.pop()).ppid() == job.pid   # the agent is xlaunch's child
        started = time.monotonic()
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
        assert job.returncode == 128 + signal.SIGTERM, job.stderr.read()
        assert time.monotonic() - started < 1 + 2.0
        assert wait_gone(job_pids(ready), 1.0) == []
        assert leftovers(token) == []
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_kill_9_of_the_front_leaves_nothing_running(tmp_path: Path) -> None:
    """SIGKILL gives xlaunch no chance: its watchdog stops the agent, the ranks and their children
    (all ignoring SIGTERM) within the grace period, then removes the front's private folder (the ranks'
    FIFOs: every kill -9 left one in /tmp, 153 here)."""
    program, token = _rank_program(tmp_path)
    job = subprocess.Popen(xlaunch("--nproc-per-node", "2", *loopback(), "--grace-period", "1", program, "-1", "0",
                                   "stubborn"),
                           env=job_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready = wait_ready(job, 2)
        pids = job_pids(ready)
        assert len(running(pids)) == 4
        agent = next(p for p in psutil.Process(job.pid).children() if "xlaunch.launcher.distributed.agent" in p.cmdline())
        folder = agent.environ()["XLAUNCH_FRONT_CHANNELS"]
        assert os.path.isdir(folder)
        job.kill()
        job.wait(timeout=30)
        assert wait_gone(pids, 1 + 3.0) == []
        assert wait_gone(leftovers(token), 2.0) == []
        deadline = time.monotonic() + 5.0
        while os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(folder), os.listdir(folder)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_a_rendezvous_nobody_joins_fails_within_its_bound(tmp_path: Path) -> None:
    """Node 0 of 2, and node 1 never comes: --rdzv-timeout bounds the wait (torch's default is
    10 minutes) and the one error line says what was waited for."""
    program, token = _rank_program(tmp_path)
    port = free_port()
    started = time.monotonic()
    done = subprocess.run(xlaunch("-q", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--master-addr",
                                  "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "1", program, "exit"),
                          env=job_env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].split("xlaunch: error: ", 1)[1].startswith(
        f"rendezvous: waited 1 s for the other nodes of --nnodes 2 at the master address 127.0.0.1:{port} "
        "(node 0 hosts the rendezvous store there); the ranks were not started"), done.stderr
    assert elapsed < 30, elapsed            # the agent's start (torch's import) and 1 s, not 10 minutes
    assert ready_fields(done.stdout) == {} and leftovers(token) == []
