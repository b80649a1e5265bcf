"""The process's (instance's) CPUs: XLAUNCH_CPUS, else what OpenMP's binding has not narrowed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import loader_env
from host_cpus import main_thread_cpus, planned

from xlaunch.runtime_ext.topology import process_cpus

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))
ONLINE = frozenset(range(8))
# The live tests choose both OpenMP runtimes themselves: not again in the libiomp5 rerun.
live = pytest.mark.skipif(os.environ.get("XLAUNCH_TEST_OMP_KIND") == "iomp", reason="runs libiomp5 itself")


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


# Each chooses its OpenMP runtime itself (LD_PRELOAD dropped, then set per case): test_runtime_iomp.py's
# second run of this folder under a preloaded libiomp5 would run the very same processes again.
CHOOSES_ITS_RUNTIME = pytest.mark.skipif(os.environ.get("XLAUNCH_TEST_OMP_KIND") == "iomp",
                                         reason="chooses its OpenMP runtime itself: the [intel] case ran already")


@live
@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")
@CHOOSES_ITS_RUNTIME
@pytest.mark.parametrize("omp", ["gnu", "intel"])
def test_default_pool_after_openmp_bound_the_main_thread(omp, iomp_path):
    """Outside xlaunch, with the user's own OpenMP binding: torch first, then xlaunch."""
    pytest.importorskip("torch")
    a, b = ALLOWED[:2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLAUNCH_", "OMP_", "KMP_", "LD_PRELOAD"))}
    if omp == "gnu":
        env.update(OMP_PROC_BIND="close", OMP_PLACES=f"{{{a}}},{{{b}}}")
    else:
        env.update(loader_env.preload(iomp_path, base=env), KMP_AFFINITY=f"granularity=fine,proclist=[{a},{b}],explicit")
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


INSTANCE_PROGRAM = """
import os, threading, torch
torch.ones(256, 256) @ torch.ones(256, 256)          # OpenMP has started (and bound) its team
from xlaunch import CPUPool, MultiStreamModule

def status_cpus(tid):
    with open(f"/proc/self/task/{tid}/status") as status:
        line = next(l for l in status if l.startswith("Cpus_allowed_list:"))
    return line.split(":")[1].strip()

seen = []
worker = threading.Thread(target=lambda: seen.append(status_cpus(threading.get_native_id())))
worker.start()
worker.join()
model = torch.nn.Linear(4, 2).eval()
with torch.no_grad(), MultiStreamModule(model, 2, CPUPool()) as streams:
    same = torch.allclose(streams(torch.ones(4, 4)), model(torch.ones(4, 4)))
print("pool", list(CPUPool().cpus), "thread", seen[0], "main", status_cpus(os.getpid()), "streams", same)
"""


@live
@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")
@CHOOSES_ITS_RUNTIME
@pytest.mark.parametrize("omp", ["default", "intel"])
def test_inside_a_two_cpu_instance_after_torch_ran(omp, tmp_path, iomp_path):
    pytest.importorskip("torch")
    from xlaunch.cpulist import format_cpulist

    script = tmp_path / "instance.py"
    script.write_text(INSTANCE_PROGRAM)
    env = loader_env.without_openmp_and_preloads()
    argv = ["-q", "--ninstances", "1", "--ncores-per-instance", "2", "--omp-runtime", omp, str(script)]
    [instance] = planned(argv, env)
    result = subprocess.run([sys.executable, "-m", "xlaunch", *argv], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0 and not result.stderr, result.stderr
    mine = instance["cpus"]
    # Intel OpenMP binds only the team's workers: the main thread, and threads it starts, keep
    # the instance. GNU OpenMP binds the master too (measured faster, docs/runtime.md): the main
    # thread and later threads are on the first CPU, but CPUPool() is still the instance.
    main = format_cpulist(main_thread_cpus(instance))
    assert main == (format_cpulist(mine) if omp == "intel" else str(mine[0]))
    assert result.stdout.strip() == f"[0] pool {mine} thread {main} main {main} streams True", result.stdout
