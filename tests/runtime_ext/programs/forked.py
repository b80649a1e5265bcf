"""A child forked while a Task, streams and a main-thread pin are live (needs CPUs 0 and 1).

The child cannot use the parent's workers (RuntimeError), closes them without blocking, leaves
the pin without touching the parent's threads, and exits normally; the parent is unaffected.
"""
import os
import sys

import torch

from xlaunch import CPUPool, MultiStreamModule, Task

allowed = os.sched_getaffinity(0)
model = torch.nn.Linear(4, 2).eval()
x = torch.randn(4, 4)
task = Task(model, CPUPool([1]))
streams = MultiStreamModule(model, 2, CPUPool([0, 1]))
pool = CPUPool([0])
pool.__enter__()
task(x).result()
streams(x)

pid = os.fork()
if pid == 0:
    for use in (lambda: task(x), lambda: streams(x)):
        try:
            use()
        except RuntimeError as error:
            assert "forked" in str(error), error
        else:
            sys.exit(3)
    task.close()
    streams.close()
    pool.__exit__(None, None, None)
    assert os.sched_getaffinity(0) == allowed, os.sched_getaffinity(0)
    sys.exit(0)

_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert os.sched_getaffinity(0) == {0}, os.sched_getaffinity(0)
print(task(x).result().shape, streams(x).shape)
