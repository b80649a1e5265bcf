"""Ends with thousands of Task calls still queued (needs CPUs 0 and 1); the test presses Ctrl-C
while the exit hook waits for them. With ``long``, a call in progress lasts 30 s, for a second Ctrl-C.
"""
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


task = Task(model, CPUPool([1]))
streams = MultiStreamModule(model, 2, CPUPool([0, 1]))
streams(x)
if sys.argv[1:] == ["long"]:
    Task(long_call, CPUPool([0]))(x)
pending = [task(x) for _ in range(20_000)]
print("end of program", flush=True)
