"""Four threads, each inside a 2-CPU pool (CPUs A,B or B,A), shrink their team again and again (a
nested 1-CPU pool, then a small torch op) and read their team back after each time.

    python pools_in_threads.py A B      # prints {"wrong": [...]}: every team seen not pinned as its pool

Needs CPUs A and B. Under LLVM libomp the extra thread of a team that shrank went back to a pool
shared by all threads' teams, so a team regrew with another thread's pinned (or an unpinned) thread.
"""
import json
import sys
import threading

import torch

from xlaunch.runtime_ext import CPUPool, threadpool_info

a, b = int(sys.argv[1]), int(sys.argv[2])
wrong: list = []
start = threading.Barrier(4)


def run(cpus: list) -> None:
    start.wait()
    with CPUPool(cpus):
        for _ in range(20):
            with CPUPool(cpus[:1]):
                torch.randn(32, 32) @ torch.randn(32, 32)
            team = [member.cpus for member in threadpool_info().team]
            if team != [(cpu,) for cpu in cpus]:
                wrong.append({"pool": cpus, "team": team})


threads = [threading.Thread(target=run, args=([a, b] if i % 2 else [b, a],)) for i in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"wrong": wrong[:5], "count": len(wrong)}))
