"""Ends with thousands of Task calls still queued (on the first two CPUs this process may use, or
its one CPU twice); the test presses Ctrl-C while the exit hook waits for them. With ``long``, a call
in progress lasts 30 s, for a second Ctrl-C.
"""
import os
import sys
import time

import torch

from xlaunch import CPUPool, MultiStreamModule, Task

model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).eval()
x = torch.randn(64, 256)


def long_call(a):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        model(a)
    return a


first, second = (sorted(os.sched_getaffinity(0)) * 2)[:2]
task = Task(model, CPUPool([second]))
streams = MultiStreamModule(model, 2, CPUPool(sorted({first, second})))
streams(x)
if sys.argv[1:] == ["long"]:
    Task(long_call, CPUPool([first]))(x)
pending = [task(x) for _ in range(20_000)]
print("end of program", flush=True)
