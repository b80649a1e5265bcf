"""Ends with thousands of Task calls still queued (on the first two CPUs this process may use, or
its one CPU twice); the test presses Ctrl-C while the exit hook waits for them (the program says when:
"waiting at exit"). With ``long``, a call
in progress lasts 30 s, for a second Ctrl-C.
"""
import os
import sys
import threading
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


def announce_the_exit_wait(_):
    """Print "waiting at exit" once the main thread waits in the exit hook for the workers (the test
    presses Ctrl-C then, not after a guessed delay); the calls queued after this one wait until then."""
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code.co_name != "_join_all":
            frame = frame.f_back
        if frame is not None:
            print("waiting at exit", flush=True)
            return None
        time.sleep(0.01)


first, second = (sorted(os.sched_getaffinity(0)) * 2)[:2]
task = Task(lambda a: announce_the_exit_wait(a) if a is None else model(a), CPUPool([second]))
streams = MultiStreamModule(model, 2, CPUPool(sorted({first, second})))
streams(x)
if sys.argv[1:] == ["long"]:
    Task(long_call, CPUPool([first]))(x)
pending = [task(None)] + [task(x) for _ in range(20_000)]
print("end of program", flush=True)
