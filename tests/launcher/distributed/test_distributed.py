"""Distributed jobs on this machine, loopback only: DDP (gloo) through ``xlaunch --nproc-per-node``,
under a plain torchrun with ``--no-python xlaunch --per-rank``, two "nodes" on 127.0.0.1, a failing
rank, SIGTERM. Each rank's CPUs are read back from /proc; leftovers are looked for with psutil."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from xlaunch.cpulist import format_cpulist, parse_cpulist

pytestmark = pytest.mark.live
if importlib.util.find_spec("torch") is None:     # found without importing it here
    pytest.skip("needs torch", allow_module_level=True)

REPO = Path(__file__).resolve().parents[3]
TRAIN = str(REPO / "examples" / "train.py")
if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 allowed CPUs", allow_module_level=True)

# a torch-free rank: reports where it runs, then fails, exits or waits as told
RANK_PROGRAM = """\
import os, sys, time
rank = int(os.environ["LOCAL_RANK"])
cpus = [l.split(":", 1)[1].strip() for l in open("/proc/self/status") if l.startswith("Cpus_allowed_list")][0]
# one write per line: ranks share the agent's stdout, and under PYTHONUNBUFFERED print() writes the
# text and its newline separately, so two ranks' lines could run together
sys.stdout.write(f"ready {rank} cpus {cpus} ppid {os.getppid()} omp {os.environ.get('OMP_NUM_THREADS')} "
                 f"rank {os.environ['RANK']} world {os.environ['WORLD_SIZE']}\\n")
sys.stdout.flush()
if sys.argv[1] == "exit":
    sys.exit(0)
if rank == int(sys.argv[1]):
    time.sleep(float(sys.argv[2]))
    sys.exit(3)
time.sleep(120)
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loopback() -> list[str]:
    """Rendezvous on 127.0.0.1 at a free port (torch's static rendezvous, node 0 of 1)."""
    return ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]


def job_env() -> dict[str, str]:
    """A clean environment: no thread settings of ours, gloo on the loopback interface."""
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def xlaunch(*argv: str) -> list[str]:
    return [sys.executable, "-m", "xlaunch", *argv]


def slices(*argv: str) -> list[str]:
    """The CPUs of each planned rank, from the front's own --dry-run --json."""
    out = subprocess.run(xlaunch(*argv[:-1], "--dry-run", "--json", argv[-1]), env=job_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [format_cpulist(i["cpus"]) for i in json.loads(out)["instances"]]


DDP_LINE = re.compile(r"ddp rank (\d+) world (\d+) local_rank (\d+) cpus (\S+) threads (\d+) "
                      r"steps/s \S+ checksum (-?[0-9.]+)")


def ddp_lines(output: str) -> dict[int, dict[str, str]]:
    """The ``ddp rank ...`` reports by rank (found anywhere: ``python -u`` ranks sharing one pipe
    may write a line's text and its newline apart)."""
    names = ("rank", "world", "local_rank", "cpus", "threads", "checksum")
    return {int(m.group(1)): dict(zip(names, m.groups())) for m in DDP_LINE.finditer(output)}


def leftovers(token: str) -> list[int]:
    """Live (non-zombie) processes whose command line mentions ``token``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and token in " ".join(proc.info["cmdline"] or ()):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def check_ddp(output: str, expected_cpus: list[str], world: int = 2) -> None:
    lines = ddp_lines(output)
    assert sorted(lines) == list(range(world)), output
    assert {v["world"] for v in lines.values()} == {str(world)}
    assert len({v["checksum"] for v in lines.values()}) == 1, output      # gradients were averaged
    for rank, fields in lines.items():
        local = int(fields["local_rank"])
        assert fields["cpus"] == expected_cpus[local], (rank, fields)
        assert fields["threads"] == str(len(parse_cpulist(expected_cpus[local])))


def test_front_trains_ddp_with_each_rank_on_its_slice() -> None:
    port = str(free_port())
    argv = ("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, TRAIN)
    expected = slices(*argv)
    assert len(expected) == 2 and not set(expected[0].split(",")) & set(expected[1].split(","))
    done = subprocess.run(xlaunch(*argv, "--ddp", "--steps", "2"), env=job_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check_ddp(done.stdout, expected)


def test_plain_torchrun_with_per_rank_ranks(tmp_path: Path) -> None:
    # an ``xlaunch`` console script of this checkout, found on PATH as a user's would be
    script = tmp_path / "xlaunch"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom xlaunch.launcher.cli.command import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = job_env()
    env["PATH"] = f"{tmp_path}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    expected = slices("--nproc-per-node", "2", TRAIN)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--no-python", "xlaunch", "--per-rank",
               TRAIN, "--ddp", "--steps", "2"]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check_ddp(done.stdout, expected)


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
    ready = [[line.split() for line in out.splitlines() if line.startswith("ready ")] for out in outputs]
    assert [len(lines) for lines in ready] == [1, 1], outputs
    # fields: ready L cpus C ppid P omp T rank R world W
    assert [(r[0][3], r[0][9], r[0][11]) for r in ready] == [(str(cpus[0]), "0", "2"), (str(cpus[1]), "1", "2")]
    assert leftovers(token) == []


def _rank_program(tmp_path: Path) -> tuple[str, str]:
    token = f"xlaunch_rank_{uuid.uuid4().hex}.py"
    path = tmp_path / token
    path.write_text(RANK_PROGRAM)
    return str(path), token


def test_failing_rank_fails_the_job_and_nothing_stays(tmp_path: Path) -> None:
    program, token = _rank_program(tmp_path)
    expected = slices("--nproc-per-node", "2", program)
    started = time.monotonic()
    done = subprocess.run(xlaunch("--nproc-per-node", "2", *loopback(), "--grace-period", "2", program, "1", "1"),
                          env=job_env(), cwd=REPO, capture_output=True, text=True, timeout=100)
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - started < 60          # rank 0 (sleeping 120 s) was stopped
    ready = sorted(line.split() for line in done.stdout.splitlines() if line.startswith("ready "))
    # fields: ready L cpus C ppid P omp T rank R world W
    assert [(r[1], r[3]) for r in ready] == [("0", expected[0]), ("1", expected[1])], done.stdout
    assert all(r[7] == "1" for r in ready)          # OMP_NUM_THREADS: the slice's size, not torchrun's 1
    assert len({r[5] for r in ready}) == 1          # both ranks are children of the same agent (exec'd)
    assert leftovers(token) == []


def wait_ready(job: subprocess.Popen, count: int, timeout: float = 60) -> list[bytes]:
    """Read the job's stdout until ``count`` ranks printed their ``ready`` line."""
    seen: list[bytes] = []
    ready = selectors.DefaultSelector()
    ready.register(job.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buffer = b""
    while len(seen) < count and time.monotonic() < deadline:
        if ready.select(timeout=1):
            chunk = os.read(job.stdout.fileno(), 4096)
            if not chunk:
                break
            buffer += chunk
            seen = [line for line in buffer.splitlines() if line.startswith(b"ready ")]
    ready.close()
    assert len(seen) == count, (buffer, job.poll())
    return seen


def test_sigterm_mid_run_leaves_nothing_running(tmp_path: Path) -> None:
    program, token = _rank_program(tmp_path)
    job = subprocess.Popen(xlaunch("--nproc-per-node", "2", *loopback(), "--grace-period", "2", program, "-1", "0"),
                           env=job_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = wait_ready(job, 2)
        assert {int(line.split()[5]) for line in seen} == {job.pid}   # ranks are the agent's children
        ranks = [p.pid for p in psutil.Process(job.pid).children(recursive=True)]
        assert len(ranks) >= 2
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
        assert job.returncode == 128 + signal.SIGTERM, job.stderr.read()
        assert leftovers(token) == []
        assert not [pid for pid in ranks if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_ranks_die_with_a_killed_front(tmp_path: Path) -> None:
    """SIGKILL gives the agent no chance to stop its ranks: the kernel does (PR_SET_PDEATHSIG)."""
    program, token = _rank_program(tmp_path)
    job = subprocess.Popen(xlaunch("--nproc-per-node", "2", *loopback(), program, "-1", "0"),
                           env=job_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        wait_ready(job, 2)
        assert len(set(leftovers(token)) - {job.pid}) == 2     # the two ranks (the front names it too)
        job.kill()
        job.wait(timeout=30)
        deadline = time.monotonic() + 15
        while leftovers(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(token) == []
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
