"""Observation of real processes: preloaded allocator, pinned threads, two OpenMP runtimes,
anonymous memory per node, process trees, orphans and processes that vanish.

Every observed program is a child that reports ``ready`` once set up, then waits for its
stdin to close; each must exit 0 with an empty stderr.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import loader_env

from conftest import require
from xlaunch.launcher.observe.observer import Observer, compare, to_json
from xlaunch.launcher.observe.procfs import sample

pytestmark = pytest.mark.live

PY = sys.executable
REPO = Path(__file__).resolve().parents[3]
TORCH_LIB = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "torch" / "lib"

WAIT = "import sys; print('ready', flush=True); sys.stdin.read()\n"


@pytest.fixture(scope="session")
def gomp_path() -> str:
    """Its real path, as /proc/PID/maps shows it (the venv may be reached through a symlink)."""
    hits = sorted(glob.glob(str(TORCH_LIB / "libgomp*.so*")))
    return os.path.realpath(require("torch's libgomp", hits[0] if hits else None))


def start(code: str, **env: str) -> subprocess.Popen:
    child = subprocess.Popen([PY, "-c", code], env={**os.environ, **env}, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    line = child.stdout.readline()
    if line != b"ready\n":
        child.kill()
        _, err = child.communicate()
        pytest.fail(f"child did not start: {line!r} {err.decode()}")
    return child


def finish(child: subprocess.Popen) -> None:
    out, err = child.communicate(b"", timeout=60)
    assert child.returncode == 0, err.decode()
    assert err == b""


def observe(child: subprocess.Popen, mem_nodes=(0,), polls: int = 2):
    observer = Observer(child.pid, mem_nodes)
    for _ in range(polls):
        assert observer.poll(force=True)
    return observer.observed


PINNED_THREADS = """
import os, threading
os.sched_setaffinity(0, {0})
pinned = threading.Barrier(3)
done = threading.Event()
def work():
    os.sched_setaffinity(0, {1})
    sum(range(200000))            # run on CPU 1 at least once
    pinned.wait()
    done.wait()
threads = [threading.Thread(target=work) for _ in range(2)]
for t in threads:
    t.start()
pinned.wait()
""" + WAIT + """
done.set()
for t in threads:
    t.join()
"""


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
@pytest.mark.parametrize("run", range(3))
def test_preloaded_jemalloc_and_threads_pinned_to_cpu_1(jemalloc_path, run):
    child = start(PINNED_THREADS, LD_PRELOAD=jemalloc_path)
    try:
        observed = observe(child)
    finally:
        finish(child)
    assert observed.allocator == "jemalloc"
    assert ("jemalloc", jemalloc_path) in observed.libraries
    assert observed.threads == 3 and observed.processes == 1
    by_thread = dict(observed.cpus_by_thread)
    assert by_thread[child.pid] == (0,)
    assert sorted(cpus for tid, cpus in by_thread.items() if tid != child.pid) == [(1,), (1,)]
    assert observed.thread_cpus == (0, 1)
    assert compare(observed, (0, 1), (0,), "jemalloc", "gnu") == []
    assert compare(observed, (0,), (0,), "jemalloc", "gnu") == [
        "2 of 3 threads ran outside the planned CPUs 0 (seen on 1)"]
    assert compare(observed, (0, 1), (0,), "tcmalloc", None) == [
        "allocator tcmalloc was planned but never mapped (ran with jemalloc)"]
    data = to_json(observed)
    assert data["allocator"] == "jemalloc" and data["threads"] == 3 and data["thread_cpus"] == [0, 1]
    assert data["openmp"] == []


def test_two_openmp_runtimes_loaded_by_a_program_are_a_warning(gomp_path, iomp_path):
    child = start(f"import ctypes; ctypes.CDLL({gomp_path!r}); ctypes.CDLL({iomp_path!r})\n" + WAIT)
    try:
        observed = observe(child, polls=1)
    finally:
        finish(child)
    assert set(observed.openmp) == {"gnu", "intel"}
    assert observed.openmp_conflicts == ((child.pid, observed.openmp_active),)
    assert observed.allocator == "glibc"
    [line] = compare(observed, (), (0,), None, "intel")
    assert line.startswith(f"2 OpenMP runtimes mapped in process {child.pid}: ")
    assert gomp_path in line and os.path.realpath(iomp_path) in line


def test_preloaded_intel_openmp_shadows_libgomp(gomp_path, iomp_path):
    child = start(f"import ctypes; ctypes.CDLL({gomp_path!r})\n" + WAIT, **loader_env.preload(iomp_path))
    try:
        observed = observe(child, polls=1)
    finally:
        finish(child)
    assert observed.openmp == ("intel",)
    assert observed.openmp_shadowed == (gomp_path,)
    assert observed.openmp_conflicts == ()
    assert compare(observed, (), (0,), None, "intel") == []
    assert to_json(observed)["openmp_shadowed"] == [{"runtime": "gnu", "path": gomp_path}]


def test_anonymous_memory_is_counted_on_its_node():
    child = start("buffer = bytearray(96 << 20)\nbuffer[::4096] = b'x' * len(buffer[::4096])\n" + WAIT)
    try:
        observed = observe(child, polls=1)
    finally:
        finish(child)
    nodes = dict(observed.memory_by_node)
    assert sum(nodes.values()) >= 96 << 20
    local = min(nodes, key=lambda n: -nodes[n])
    assert observed.remote_memory_pct([local]) < 10.0
    other = local + 1                          # a node the memory is not on
    assert observed.remote_memory_pct([other]) > 90.0
    [line] = compare(observed, (), (other,), None, None)
    assert f"outside its memory nodes {other}" in line


def test_children_of_the_instance_are_observed(jemalloc_path):
    grandchild = WAIT.replace("print(", "import os; print(os.getpid(), ")
    leader = (
        "import os, subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE,"
        f" env=dict(os.environ, LD_PRELOAD={jemalloc_path!r}))\n"
        "pid = p.stdout.readline().split()[0].decode()\n"
        "print('ready', pid, flush=True); sys.stdin.read(); p.communicate(b'')\n"
    )
    child = subprocess.Popen([PY, "-c", leader], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        ready, grandchild_pid = child.stdout.readline().split()
        assert ready == b"ready"
        one = sample(child.pid)
    finally:
        finish(child)
    assert [p.pid for p in one.processes] == [child.pid, int(grandchild_pid)]
    assert [k for k, _ in one.processes[0].libraries] == []
    assert ("jemalloc", jemalloc_path) in one.processes[1].libraries


SUBREAPER = r"""
import ctypes, json, os, subprocess, sys
from xlaunch.launcher.observe.observer import Observer, to_json
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)          # PR_SET_CHILD_SUBREAPER
orphan = "import sys; print('ready', flush=True); sys.stdin.read()"
leader = subprocess.Popen(
    [sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', %r])" % orphan],
    stdout=subprocess.PIPE, stdin=subprocess.PIPE, start_new_session=True, env=dict(os.environ, LD_PRELOAD=sys.argv[1]))
assert leader.stdout.readline() == b"ready\n"
assert leader.wait() == 0                                          # the leader is gone and reaped
observer = Observer(leader.pid, (0,))
observer.poll(force=True)
print(json.dumps(to_json(observer.observed)))
leader.stdin.close()                                               # the orphan reads EOF and exits
os.waitid(os.P_PGID, leader.pid, os.WEXITED)
"""


def test_orphans_left_in_the_group_are_observed_by_a_subreaper(jemalloc_path):
    for _ in range(2):
        run = subprocess.run([PY, "-c", SUBREAPER, jemalloc_path], capture_output=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert run.returncode == 0 and run.stderr == b"", run.stderr.decode()
        data = json.loads(run.stdout)
        assert data["processes"] == 1 and data["allocator"] == "jemalloc"


def test_processes_that_end_or_were_reaped_are_not_an_error():
    child = subprocess.Popen([PY, "-c", "pass"], stderr=subprocess.PIPE)
    observer = Observer(child.pid, (0,), interval=0.001)
    deadline = time.monotonic() + 30
    while child.poll() is None and time.monotonic() < deadline:   # sampled while it starts and ends
        observer.poll()
    zombie_or_gone = sample(child.pid)
    assert zombie_or_gone.processes == ()
    assert child.returncode == 0 and child.stderr.read() == b""
    observer.poll(force=True)
    observed = observer.observed
    assert observed.samples >= 2
    assert observed.processes <= 1
    expected = ["allocator jemalloc was planned but never mapped (ran with glibc)"] if observed.processes else []
    assert compare(observed, tuple(os.sched_getaffinity(0)), (0,), "jemalloc", None) == expected


def test_a_zombie_leader_is_skipped():
    child = subprocess.Popen([PY, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{child.pid}/stat") as handle:
            if handle.read().rpartition(")")[2].split()[0] == "Z":
                break
        time.sleep(0.01)
    try:
        assert sample(child.pid).processes == ()
        observer = Observer(child.pid, (0,))
        observer.poll()
        assert observer.observed.allocator is None and to_json(observer.observed)["threads"] == 0
    finally:
        assert child.wait() == 0
