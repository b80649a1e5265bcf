"""Leaves runtime objects in every state at interpreter exit (needs CPUs 0 and 1).

Open streams and Task (the program of issue 12), calls still queued (the worker busy as the
program ends), a Task dropped without
close() with work queued, streams dropped without close(), objects closed by a ``with`` block that an exception left, and the main
thread's OpenMP team still pinned.
"""
import gc

import torch

from xlaunch import CPUPool, MultiStreamModule, Task

model = torch.nn.Linear(4, 2).eval()
x = torch.randn(4, 4)

streams = MultiStreamModule(model, 2, CPUPool([0, 1]))
print(streams(x).shape)
task = Task(model, CPUPool([1]))
print(task(x).result().shape)
pending = [task(x) for _ in range(8)]

dropped = Task(model, CPUPool([0]))
for _ in range(4):
    dropped(x)
dropped_streams = MultiStreamModule(model, 2, CPUPool([0, 1]))
dropped_streams(x)
del dropped, dropped_streams
gc.collect()

try:
    with Task(model, CPUPool([0])) as failing, MultiStreamModule(model, 2, CPUPool([0, 1])) as more:
        failing(x).result()
        more(x)
        raise KeyError("leaving the with blocks by an exception")
except KeyError:
    pass
assert failing.closed and more.closed

CPUPool([0, 1]).__enter__()
model(x)
busy_at_exit = [task(x) for _ in range(300)]  # the worker is still computing when the program ends
print("end of program")
