"""Thread-pool control (module named so it does not shadow the ``threads`` function): count, runtime, affinity.

    threadpool_info()          # runtime kind and path, thread count, each team thread's CPUs
    set_num_threads(4)         # torch (OpenMP + MKL) when torch is imported, else OpenMP alone
    with threads(1): ...       # the same, restored on exit
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from xlaunch.runtime_ext import openmp
from xlaunch._errors import as_index
from xlaunch.runtime_ext.pool import get_thread_count, set_thread_count

AFFINITY_ENV = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class TeamThread:
    """One thread of the calling thread's OpenMP team."""

    thread_num: int            # omp_get_thread_num(); 0 is the calling thread
    tid: int                   # kernel thread id (/proc/self/task/<tid>)
    cpus: tuple[int, ...]      # its affinity, sched_getaffinity


@dataclass(frozen=True)
class ThreadPoolInfo:
    """The OpenMP runtime in use and the calling thread's team."""

    kind: str                          # gomp | iomp | omp
    path: str                          # the library file in use
    num_threads: int                   # team size the next parallel region of this thread gets
    team: tuple[TeamThread, ...]       # one entry per team thread (a region of num_threads is run)
    mapped: tuple[str, ...]            # every OpenMP runtime mapped into the process
    pinning_supported: bool
    env: tuple[tuple[str, str], ...]   # OpenMP affinity variables set in the environment

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def threadpool_info() -> ThreadPoolInfo:
    """Describe the OpenMP runtime and the calling thread's team (runs one empty parallel region)."""
    runtime = openmp.loaded_runtime()
    size = get_thread_count(runtime)
    team: dict[int, TeamThread] = {}
    if runtime.can_run_teams:

        def report(thread_num: int, team_size: int) -> None:
            team[thread_num] = TeamThread(thread_num, threading.get_native_id(), tuple(sorted(os.sched_getaffinity(0))))

        runtime.run_on_team(size, report)
    return ThreadPoolInfo(
        kind=runtime.kind,
        path=runtime.path,
        num_threads=size,
        team=tuple(team[i] for i in sorted(team)),
        mapped=tuple(m.path for m in openmp.mapped_runtimes()),
        pinning_supported=openmp.pinning_supported(),
        env=tuple((k, os.environ[k]) for k in AFFINITY_ENV if k in os.environ),
    )


def get_num_threads() -> int:
    """The calling thread's team size."""
    return get_thread_count(openmp.loaded_runtime())


def set_num_threads(n: int) -> None:
    """Set the calling thread's team size (torch's setting when torch is imported)."""
    count = as_index(n)      # numpy's integers too; never a bool or a float
    if count is None or count < 1:
        raise ValueError(f"number of threads must be a positive integer, got {n!r}")
    set_thread_count(openmp.loaded_runtime(), count)


@contextlib.contextmanager
def threads(n: int) -> Iterator[int]:
    """Run the block with a team of ``n`` threads, then restore the previous count."""
    previous = get_num_threads()
    set_num_threads(n)
    try:
        yield n
    finally:
        set_num_threads(previous)
