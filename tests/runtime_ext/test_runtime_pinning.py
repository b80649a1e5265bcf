"""Pinning the OpenMP team, read back from /proc/self/task/<tid>/status.

This file also runs under LD_PRELOAD=libiomp5 and under LLVM's libomp (test_runtime_iomp.py), where
XLAUNCH_TEST_OMP_KIND=iomp or omp says which runtime must be found.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from _runtime_helpers import team_tids, thread_cpu_ticks, thread_cpus, thread_ids  # noqa: E402

from xlaunch.runtime_ext import CPUPool, openmp, pin, set_num_threads, threadpool_info, threads  # noqa: E402

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")
# two of the CPUs this process may use (not CPUs 0 and 1: under taskset or a cpuset they may not be)
A, B = (ALLOWED * 2)[:2]


def expected_kind() -> str:
    if "XLAUNCH_TEST_OMP_KIND" in os.environ:
        return os.environ["XLAUNCH_TEST_OMP_KIND"]
    return "iomp" if "libiomp5" in os.environ.get("LD_PRELOAD", "") else "gomp"


@pytest.fixture(autouse=True)
def restore_process_state():
    """Every test starts and ends with the main thread free on all allowed CPUs."""
    threads_before = torch.get_num_threads()
    yield
    assert tuple(sorted(os.sched_getaffinity(0))) == ALLOWED
    assert torch.get_num_threads() == threads_before


def test_the_runtime_torch_uses_is_found():
    runtime = openmp.loaded_runtime()
    assert runtime.kind == expected_kind()
    mapped = {m.path: m.kind for m in openmp.mapped_runtimes()}
    assert mapped[runtime.path] == runtime.kind
    assert openmp.pinning_supported()
    info = threadpool_info()
    assert (info.kind, info.path) == (runtime.kind, runtime.path)
    assert info.num_threads == torch.get_num_threads() == len(info.team)
    for member in info.team:
        assert member.cpus == thread_cpus(member.tid)


@needs_two
@pytest.mark.parametrize("order", ["B", "A", "AB", "BA"])
def test_team_threads_pinned_and_restored(order):
    cpus = [{"A": A, "B": B}[name] for name in order]
    size = len(cpus)
    main_tid = threading.get_native_id()
    before = {tid: thread_cpus(tid) for tid in team_tids(torch.get_num_threads())}
    with CPUPool(cpus) as pool:
        assert pool.cpus == tuple(cpus)
        assert torch.get_num_threads() == size
        tids = team_tids(size)
        assert tids[0] == main_tid
        assert [thread_cpus(tid) for tid in tids] == [(cpu,) for cpu in cpus]
    for tid, cpus_before in before.items():
        assert thread_cpus(tid) in (cpus_before, None)     # None: the thread has ended since
    for tid in tids:
        assert thread_cpus(tid) in (ALLOWED, None)


@needs_two
def test_torch_work_runs_on_the_pinned_team():
    a = torch.randn(384, 384)
    with CPUPool([B, A]):
        tids = team_tids(2)
        others = thread_ids() - set(tids)
        ticks = {tid: thread_cpu_ticks(tid) for tid in thread_ids()}
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            (a @ a).relu_().sum()
            torch.nn.functional.conv2d(torch.randn(8, 16, 32, 32), torch.randn(16, 16, 3, 3))
        assert [thread_cpus(tid) for tid in tids] == [(B,), (A,)]
        assert thread_ids() - set(ticks) == set(), "torch started threads outside the pinned team"
        gained = {tid for tid in thread_ids() if thread_cpu_ticks(tid) > ticks[tid]}
        assert tids[1] in gained, "the pinned worker thread did none of torch's work"
        assert not (gained & others) - {tids[0]}


@needs_two
def test_nesting_restores_the_outer_pin():
    with pin(CPUPool([B])):
        assert thread_cpus(threading.get_native_id()) == (B,)
        with CPUPool([A, B]):
            inner = team_tids(2)
            assert [thread_cpus(t) for t in inner] == [(A,), (B,)]
            assert torch.get_num_threads() == 2
        assert thread_cpus(threading.get_native_id()) == (B,)
        assert torch.get_num_threads() == 1
    assert thread_cpus(threading.get_native_id()) == ALLOWED


@needs_two
def test_pin_as_decorator_and_reentrant():
    @pin([A])
    def where(depth: int) -> list:
        here = [thread_cpus(threading.get_native_id())]
        return here + (where(depth - 1) if depth else [])

    assert where(2) == [(A,), (A,), (A,)]
    assert thread_cpus(threading.get_native_id()) == ALLOWED


def test_pin_restores_after_an_exception():
    with pytest.raises(KeyError):
        with CPUPool([ALLOWED[-1]]):
            assert thread_cpus(threading.get_native_id()) == (ALLOWED[-1],)
            raise KeyError("boom")
    assert thread_cpus(threading.get_native_id()) == ALLOWED


def test_pins_in_two_threads_are_independent():
    seen: dict[int, tuple] = {}
    barrier = threading.Barrier(2)

    def run(cpu: int) -> None:
        with CPUPool([cpu]):
            barrier.wait()
            seen[cpu] = thread_cpus(threading.get_native_id())
            barrier.wait()
        seen[-1 - cpu] = thread_cpus(threading.get_native_id())

    workers = [threading.Thread(target=run, args=(cpu,)) for cpu in (ALLOWED[0], ALLOWED[-1])]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert seen[ALLOWED[0]] == (ALLOWED[0],) and seen[ALLOWED[-1]] == (ALLOWED[-1],)
    assert seen[-1 - ALLOWED[0]] == ALLOWED


def test_thread_count_control():
    before = torch.get_num_threads()
    with threads(1):
        assert torch.get_num_threads() == 1
        assert openmp.loaded_runtime().get_max_threads() == 1
        assert threadpool_info().num_threads == 1
    assert torch.get_num_threads() == before
    set_num_threads(1)
    try:
        assert torch.get_num_threads() == 1
    finally:
        set_num_threads(before)
    with pytest.raises(ValueError, match="positive"):
        set_num_threads(0)
    np = pytest.importorskip("numpy")
    for wrong in (1.0, True, "1"):
        with pytest.raises(ValueError, match="^number of threads must be a positive integer"):
            set_num_threads(wrong)
    with threads(np.int64(1)):       # numpy's integers are counts (they were refused)
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


TEAM_SIZES_SEEN_BY_OTHER_THREADS = """
import json, sys, threading
import torch
from xlaunch.runtime_ext import CPUPool, MultiStreamModule, Task

a, b = int(sys.argv[1]), int(sys.argv[2])

def fresh_thread_team() -> int:
    seen = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    return seen[0]

seen = {"before": fresh_thread_team()}
with CPUPool([a]):
    seen["while the main thread is pinned"] = fresh_thread_team()
with Task(torch.nn.Linear(4, 2), CPUPool([b])) as task:
    task(torch.randn(4, 4)).result()
    seen["while a task is open"] = fresh_thread_team()
with MultiStreamModule(torch.nn.Linear(4, 2), 2, CPUPool([a, b])) as streams:
    streams(torch.randn(4, 4))
seen["after streams closed"] = fresh_thread_team()
seen["main thread after all"] = torch.get_num_threads()
print(json.dumps(seen))
"""


@needs_two
def test_a_pin_leaves_other_threads_team_size_alone():
    """A pin sizes its own thread's team only: torch.set_num_threads also sets the process's
    default (what a thread's first torch op starts with), so threads started meanwhile, and the
    main thread after a MultiStreamModule, ran on one thread."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", TEAM_SIZES_SEEN_BY_OTHER_THREADS, str(A), str(B)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    seen = json.loads(result.stdout)
    assert seen["before"] >= 2, seen
    assert set(seen.values()) == {seen["before"]}, seen


@needs_two
def test_a_one_cpu_pin_keeps_mkl_to_one_thread_after_set_num_threads():
    """torch.set_num_threads(2) also sets MKL's per-thread count: a 1-CPU pin sets it too (the
    team size alone left MKL's matrix products on two threads, one of them not pinned)."""
    before = torch.get_num_threads()
    a = torch.randn(512, 512)
    torch.set_num_threads(2)
    try:
        a @ a
        time.sleep(0.4)  # the runtime's threads stop spinning (KMP_BLOCKTIME is 200 ms)
        with CPUPool([A]):
            ticks = {tid: thread_cpu_ticks(tid) for tid in thread_ids()}
            deadline = time.monotonic() + 0.4
            while time.monotonic() < deadline:
                a @ a
                torch.nn.functional.linear(a, a)
            gained = {tid for tid in thread_ids() if thread_cpu_ticks(tid) > ticks.get(tid, -1)}
        assert gained <= {threading.get_native_id()}, "a thread besides the pinned one computed"
    finally:
        torch.set_num_threads(before)


@needs_two
@pytest.mark.skipif("XLAUNCH_TEST_OMP_KIND" in os.environ, reason="chooses its OpenMP runtimes itself")
def test_pools_in_many_threads_keep_their_pinned_threads_or_say_why_not(libomp_path):
    """Under LLVM libomp a team that shrank (a nested 1-CPU pool, a small torch op) gave its extra thread
    to a pool shared by every thread's team: four threads in 2-CPU pools then ran on threads pinned for
    another pool, or not pinned, in 3 runs of 3, with no message. The runtime reads the cure
    (KMP_HOT_TEAMS_MODE=1) before its first parallel region only: with it every team stays pinned;
    without it a RuntimeWarning says so. GNU libgomp keeps a pool per thread."""
    import json
    import subprocess
    import sys

    import loader_env

    program = os.path.join(os.path.dirname(__file__), "programs", "pools_in_threads.py")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LD_PRELOAD", "KMP_HOT_TEAMS_MODE")}
    omp = loader_env.preload(libomp_path)
    runs = {name: subprocess.Popen([sys.executable, program, str(A), str(B)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env={**base, **extra})
            for name, extra in (("gomp", {}), ("omp, kept", {**omp, "KMP_HOT_TEAMS_MODE": "1"}), ("omp", omp))}
    results = {name: (process.communicate(timeout=120), process.returncode) for name, process in runs.items()}
    for name in ("gomp", "omp, kept"):
        (out, err), status = results[name]
        assert status == 0 and err == "" and json.loads(out)["count"] == 0, (name, status, out, err[-2000:])
    (out, err), status = results["omp"]
    assert status == 0, err[-2000:]
    assert err.count("RuntimeWarning") == 1 and "KMP_HOT_TEAMS_MODE=1" in err, err[-2000:]
