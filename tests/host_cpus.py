"""What this process may use, for the tests whose expectations depend on it.

Imported by name (``from host_cpus import ...``), like machine_trees. Every expectation about
CPUs comes from here or from the plan xlaunch itself prints for this machine (``--dry-run
--json``), never from a count the test was written on: the suite runs under ``taskset -c 1``,
on 2 CPUs and on 16.

* :data:`ALLOWED`: ``os.sched_getaffinity(0)``, sorted;
* :func:`need_cpus` / :func:`need_cores`: skip, saying how many there are, when too few;
* :func:`planned`: the instances of a plan for this machine (skips when they do not fit);
* :func:`main_thread_cpus` and :func:`openmp_places`: what an instance's OpenMP runtime does to
  the main thread's mask and which places it reports, from the variables the plan set;
* :func:`startup_modules`: the modules the interpreter imports on its own (``python -c pass``),
  the baseline for "imports nothing heavy";
* :func:`without_budget_warning`: xlaunch's output less the warning a CPU quota below the CPUs
  earns every plan (a container's, a CI runner's), on the machines that have one.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pytest

from xlaunch.cpulist import format_cpulist, parse_cpulist

REPO = Path(__file__).resolve().parent.parent
ALLOWED: tuple[int, ...] = tuple(sorted(os.sched_getaffinity(0)))


def need_cpus(count: int) -> None:
    """Skip unless this process may use ``count`` CPUs."""
    if len(ALLOWED) < count:
        pytest.skip(f"needs {count} allowed CPUs, this process may use {len(ALLOWED)} ({format_cpulist(ALLOWED)})")


@functools.lru_cache(maxsize=None)
def allowed_cores() -> int:
    """Physical cores with an allowed CPU: the planner's unit (SMT siblings count once)."""
    from xlaunch.machine import load_machine

    machine = load_machine("/")
    allowed = set(machine.allowed_cpus)
    return sum(1 for core in machine.cores if allowed & set(core.cpus)) or len(ALLOWED)


def need_cores(count: int) -> None:
    """Skip unless ``count`` physical cores are allowed (what ``--ninstances count`` needs)."""
    if allowed_cores() < count:
        pytest.skip(f"needs {count} allowed cores, this process may use {allowed_cores()} "
                    f"(CPUs {format_cpulist(ALLOWED)})")


def plan_json(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """xlaunch's ``--dry-run --json`` plan for ``argv`` (options, then the program) on this machine.

    In this process (``cli.run``, what ``python -m xlaunch`` runs), under ``env`` (default: this
    environment) without ``XLAUNCH_FSROOT`` and from the repository root, as a child would be: the
    launches a test compares with the plan are the real processes."""
    import contextlib
    import io

    from xlaunch.launcher.cli.command import run

    environ = dict(os.environ if env is None else env)
    environ.pop("XLAUNCH_FSROOT", None)
    saved, cwd, out, err = dict(os.environ), os.getcwd(), io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(environ)           # the machine model reads XLAUNCH_FSROOT from here
        os.chdir(REPO)                       # (contextlib.chdir is Python 3.11+; the launcher runs on 3.9)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run(["--dry-run", "--json", *argv], environ)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    if code == 2 and " need " in err.getvalue() and "available" in err.getvalue():
        pytest.skip(f"this machine is too small for the plan: {err.getvalue().strip()}")
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def planned(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> list[dict[str, Any]]:
    """The instances (``cpus``, ``env``, ...) xlaunch plans for ``argv`` on this machine."""
    return plan_json(argv, env)["instances"]


def openmp_places(instance: Mapping[str, Any]) -> list[list[int]]:
    """The places an instance's OpenMP runtime reports (``omp_get_place_proc_ids``), from the
    variables the plan set: GNU's ``OMP_PLACES={a},{b}``, Intel's ``KMP_AFFINITY`` proclist
    (``[{a,b,c},b,c]``: the master on the whole instance, each worker on one CPU)."""
    env = instance["env"]
    if "KMP_AFFINITY" in env:
        proclist = env["KMP_AFFINITY"].split("proclist=[", 1)[1].rsplit("]", 1)[0]
        return [list(parse_cpulist(part.strip("{}"))) for part in _split_places(proclist)]
    return [list(parse_cpulist(part.strip("{}"))) for part in _split_places(env["OMP_PLACES"])]


def _split_places(text: str) -> list[str]:
    """``{0,1,2},1,2`` -> ``["{0,1,2}", "1", "2"]`` (commas inside braces do not split)."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += (char == "{") - (char == "}")
        current += char
    return parts + [current] if current else parts


def main_thread_cpus(instance: Mapping[str, Any], *, started: bool = True) -> list[int]:
    """The main thread's mask (``/proc/self/status``) once the instance's OpenMP runtime has
    started (``started``: a parallel region ran), as the plan's variables make it.

    GNU OpenMP (``OMP_PROC_BIND`` with ``OMP_PLACES``) binds the main thread to the first place
    when the library loads; Intel OpenMP binds it at the first parallel region, to the first
    proclist entry: the whole instance (``team_places``). Any other thread the main thread
    starts afterwards inherits that mask. The process's own CPUs stay the instance's.
    """
    env = instance["env"]
    if env.get("OMP_PROC_BIND", "false").lower() not in ("false", "") and "OMP_PLACES" in env:
        return openmp_places(instance)[0]
    if "KMP_AFFINITY" in env and started:
        return openmp_places(instance)[0]
    return list(instance["cpus"])


@functools.lru_cache(maxsize=None)
def _startup_modules(python: str, environ: tuple[tuple[str, str], ...], cwd: str) -> frozenset[str]:
    code = "import sys; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=dict(environ), cwd=cwd,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return frozenset(done.stdout.split())


def startup_modules(python: str = sys.executable, env: Optional[Mapping[str, str]] = None,
                    cwd: Path = REPO) -> frozenset[str]:
    """What ``python -c pass`` has imported by the time its code runs (site, sitecustomize, .pth
    files: ``inspect`` and ``typing`` on some distributions' interpreters), with the same
    environment and directory: a module among these costs a program of ours nothing."""
    environ = dict(os.environ if env is None else env)
    return _startup_modules(python, tuple(sorted(environ.items())), str(cwd))


def heavy_imports(imported: Sequence[str], heavy: Sequence[str], baseline: frozenset[str]) -> list[str]:
    """Those of ``heavy`` (top-level names) that ``imported`` holds beyond the interpreter's own."""
    tops = {name.split(".")[0] for name in imported if name not in baseline}
    return sorted(name for name in heavy if name in tops)


@functools.lru_cache(maxsize=None)
def cpu_budget() -> Optional[float]:
    """The cgroup CPU quota on the way to this process, in CPUs (None: no quota), as xlaunch reads it."""
    from xlaunch.machine import load_machine

    return load_machine("/").cpu_budget


BUDGET_WARNING = re.compile(r"xlaunch: warning: the cgroup CPU budget is [0-9.]+ CPUs but the plan runs \d+ "
                            r"OpenMP threads: expect throttling \(ask for fewer cores\)")


def without_budget_warning(stderr: str) -> str:
    """``stderr`` without the line "the cgroup CPU budget is B CPUs but the plan runs N OpenMP threads",
    where this machine has a quota below its allowed CPUs (the warning is right there, and it is the only
    line a test of clean output forgives); unchanged on a machine without a quota."""
    budget = cpu_budget()
    if budget is None or budget >= len(ALLOWED):
        return stderr
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if not BUDGET_WARNING.fullmatch(line.rstrip("\n")))
