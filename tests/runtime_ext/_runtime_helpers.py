"""Read thread facts back from /proc, and build the example model, for the runtime tests."""
from __future__ import annotations

import os
import runpy
import threading
from pathlib import Path
from typing import Optional

from xlaunch.cpulist import parse_cpulist

REPO = Path(__file__).resolve().parents[2]


def thread_cpus(tid: int) -> Optional[tuple[int, ...]]:
    """Cpus_allowed_list of one thread of this process, from /proc/self/task/<tid>/status;
    None when the thread has ended (listed a moment ago, gone now: OpenMP runtimes end surplus
    team threads when a smaller team starts)."""
    try:
        with open(f"/proc/self/task/{tid}/status") as status:
            for line in status:
                if line.startswith("Cpus_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    raise AssertionError(f"no Cpus_allowed_list for thread {tid}")


def thread_ids() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/task")}


def thread_cpu_ticks(tid: int) -> int:
    """utime + stime of one thread, in clock ticks (/proc/self/task/<tid>/stat); -1 when the
    thread has ended."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return -1
    return int(fields[11]) + int(fields[12])


def team_tids(size: int) -> list[int]:
    """Kernel ids of the calling thread's OpenMP team of ``size``, by thread number."""
    from xlaunch.runtime_ext import openmp

    tids: dict[int, int] = {}

    def report(thread_num: int, team_size: int) -> None:
        tids[thread_num] = threading.get_native_id()

    openmp.loaded_runtime().run_on_team(size, report)
    return [tids[i] for i in sorted(tids)]


def small_cnn():
    """examples/infer.py's model, seeded, in eval mode."""
    import torch

    torch.manual_seed(0)
    return runpy.run_path(str(REPO / "examples" / "infer.py"))["small_cnn"]().eval()
