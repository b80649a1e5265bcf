"""Run a program many times, each run a forked child that exits through normal interpreter exit.

    python _exit_driver.py PROGRAM.py:RUNS [PROGRAM.py:RUNS ...]

torch is imported once here (no op is run, so no OpenMP team exists yet); every child runs
PROGRAM's code as ``__main__`` and leaves through ``SystemExit`` to the top level, i.e. the same
``Py_FinalizeEx`` path as a fresh ``python PROGRAM.py`` -- at a fraction of the start-up cost.
Prints one JSON line: the exit code of every child, in order (negative: killed by that signal).
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch  # noqa: F401 - imported once, before forking

# Children never collect the objects that existed before the fork: their exit then skips
# traversing torch's module graph (copy-on-write faults), ~0.4 s instead of ~1 s per child.
gc.collect()
gc.freeze()

jobs = []
for argument in sys.argv[1:]:
    program, _, runs = argument.rpartition(":")
    with open(program) as source:
        jobs.extend([(program, compile(source.read(), program, "exec"))] * int(runs))

codes = []
for program, code in jobs:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        # The program's globals stay referenced from here, so what it leaves behind is still
        # alive when the interpreter exits, as in a script.
        program_globals = {"__name__": "__main__", "__file__": program}
        exec(code, program_globals)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    codes.append(os.waitstatus_to_exitcode(status))
print(json.dumps({"codes": codes}))
