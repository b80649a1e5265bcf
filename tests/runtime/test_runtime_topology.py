"""The process's (instance's) CPUs: XLAUNCH_CPUS, else what OpenMP's binding has not narrowed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from xlaunch.runtime_ext.topology import process_cpus

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
ONLINE = frozenset(range(8))


def cpus(*ids: int) -> frozenset[int]:
    return frozenset(ids)


def decide(env: str | None = None, *, at_import=cpus(0, 1, 2, 3), main=cpus(0), places=cpus(), online=ONLINE):
    environ = {} if env is None else {"XLAUNCH_CPUS": env}
    return process_cpus(environ, at_import=at_import, main_thread=main, openmp_places=places, online=online)


def test_instance_variable_wins_when_the_process_is_inside_it():
    assert decide("2-3", at_import=cpus(2), main=cpus(2)) == (2, 3)
    assert decide("0-3,9", main=cpus(1)) == (0, 1, 2, 3)             # CPU 9 is not online


def test_stale_or_bad_instance_variable_is_ignored():
    # moved outside the instance since (taskset -p, a child restricted elsewhere)
    assert decide("2-3", at_import=cpus(5), main=cpus(5)) == (5,)
    assert decide("3-1", at_import=cpus(0, 1), main=cpus(0)) == (0, 1)  # does not parse
    assert decide("12-15", at_import=cpus(0, 1), main=cpus(0)) == (0, 1)  # none online
    assert decide("", at_import=cpus(0, 1), main=cpus(0)) == (0, 1)


def test_without_the_variable_the_narrowed_main_thread_is_widened():
    # affinity read before torch's import, main thread now bound to one CPU
    assert decide(at_import=cpus(0, 1, 2, 3), main=cpus(0)) == (0, 1, 2, 3)
    # imported after the binding: the OpenMP places name the rest
    assert decide(at_import=cpus(0), main=cpus(0), places=cpus(0, 1)) == (0, 1)
    assert decide(at_import=cpus(6, 7), main=cpus(6, 7), places=cpus(6, 7, 9)) == (6, 7)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")
@pytest.mark.parametrize("omp", ["gnu", "intel"])
def test_default_pool_after_openmp_bound_the_main_thread(omp, iomp_path):
    """Outside xlaunch, with the user's own OpenMP binding: torch first, then xlaunch."""
    pytest.importorskip("torch")
    a, b = ALLOWED[:2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLAUNCH_", "OMP_", "KMP_", "LD_PRELOAD"))}
    if omp == "gnu":
        env.update(OMP_PROC_BIND="close", OMP_PLACES=f"{{{a}}},{{{b}}}")
    else:
        env.update(LD_PRELOAD=iomp_path, KMP_AFFINITY=f"granularity=fine,proclist=[{a},{b}],explicit")
    code = (
        "import os, torch\n"
        "torch.ones(256, 256) @ torch.ones(256, 256)\n"
        "from xlaunch import CPUPool\n"
        "print(sorted(os.sched_getaffinity(0)), list(CPUPool().cpus))\n"
    )
    result = subprocess.run(["taskset", "-c", f"{a},{b}", sys.executable, "-c", code],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert result.stdout.split("] ")[-1].strip() == f"[{a}, {b}]"
    assert result.stdout.startswith(f"[{a}]")  # the binding did narrow the main thread
