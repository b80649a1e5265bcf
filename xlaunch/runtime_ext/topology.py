"""The CPUs of this process (its instance), grouped by physical core.

The one place the runtime decides which CPUs are "ours"; everything else asks
:func:`allowed_cores`. The calling thread's affinity is not the answer: an OpenMP runtime that
binds its master thread (``OMP_PROC_BIND``/``OMP_PLACES``, ``KMP_AFFINITY``) narrows the main
thread to one CPU -- libgomp when torch is imported, libiomp5 at the first parallel region --
and a ``with pool:`` block narrows it on purpose. So, in this order:

1. ``XLAUNCH_CPUS`` -- set by ``xlaunch`` for each instance to the instance's CPUs -- when the
   process's current affinity lies inside it (otherwise the process was moved elsewhere since,
   and the variable is stale);
2. else the union of the affinity this module saw when first imported, the main thread's
   affinity now, and the CPUs of the loaded OpenMP runtime's places.

Only online CPUs count. The machine's structure (cores, SMT siblings, NUMA nodes) comes from
xlaunch's machine model, read once on first use.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Mapping, Optional

from xlaunch.cpulist import CpuListError, parse_cpulist

INSTANCE_CPUS_ENV = "XLAUNCH_CPUS"


def _main_thread_affinity() -> frozenset[int]:
    """The main thread's affinity (the thread group leader's, from ``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Cpus_allowed_list:"):
                    return frozenset(parse_cpulist(line.split(":", 1)[1]))
    except (OSError, CpuListError):
        pass
    return frozenset(os.sched_getaffinity(0))


# Taken at the first import of xlaunch.runtime_ext: when that precedes torch's import (and its
# OpenMP binding), this is the affinity the process was started with.
AFFINITY_AT_IMPORT: frozenset[int] = (
    frozenset(os.sched_getaffinity(0)) if threading.current_thread() is threading.main_thread() else _main_thread_affinity()
)


@dataclass(frozen=True)
class AllowedCore:
    """A physical core with at least one CPU this process may use."""

    cpus: tuple[int, ...]     # the allowed SMT siblings, lowest first; cpus[0] is the primary
    node: Optional[int]       # NUMA node, None when unknown


def instance_cpus_from_env(environ: Mapping[str, str], current: frozenset[int], online: frozenset[int]) -> Optional[frozenset[int]]:
    """``XLAUNCH_CPUS`` (online CPUs only) when set, valid and containing ``current``; else None."""
    text = environ.get(INSTANCE_CPUS_ENV, "").strip()
    if not text:
        return None
    try:
        cpus = frozenset(parse_cpulist(text)) & online
    except CpuListError:
        return None
    if not cpus or not current <= cpus:
        return None
    return cpus


def process_cpus(
    environ: Mapping[str, str],
    *,
    at_import: frozenset[int],
    main_thread: frozenset[int],
    openmp_places: frozenset[int],
    online: frozenset[int],
) -> tuple[int, ...]:
    """The process's (instance's) CPUs from the facts above (pure; see the module docstring)."""
    current = main_thread & online
    from_env = instance_cpus_from_env(environ, current, online)
    if from_env is not None:
        return tuple(sorted(from_env))
    return tuple(sorted((at_import | main_thread | openmp_places) & online))


def _openmp_place_cpus() -> frozenset[int]:
    from xlaunch.runtime_ext import openmp

    runtime = openmp.find_runtime()
    return frozenset(runtime.place_cpus()) if runtime is not None else frozenset()


_cache: dict[tuple[int, str], tuple[int, ...]] = {}
_cache_lock = threading.Lock()


def process_cpu_set() -> tuple[int, ...]:
    """Every CPU of this process (its instance), sorted; computed once per process.

    Under a recorded machine (``XLAUNCH_FSROOT``) it is the recorded ``Cpus_allowed_list``.
    """
    from xlaunch.machine import current_machine

    machine = current_machine()
    key = (os.getpid(), machine.root)
    with _cache_lock:
        if key not in _cache:
            _cache.clear()
            if os.path.realpath(machine.root) != "/":
                _cache[key] = machine.allowed_cpus
            else:
                _cache[key] = process_cpus(
                    os.environ,
                    at_import=AFFINITY_AT_IMPORT,
                    main_thread=_main_thread_affinity(),
                    openmp_places=_openmp_place_cpus(),
                    online=frozenset(machine.online_cpus),
                )
        return _cache[key]


def clear_cache() -> None:
    """Forget the computed CPUs (after the process was moved, e.g. by ``taskset -p``)."""
    with _cache_lock:
        _cache.clear()


def allowed_cores() -> tuple[AllowedCore, ...]:
    """Allowed physical cores in machine order (by node, L3, package, core)."""
    from xlaunch.machine import current_machine

    allowed = set(process_cpu_set())
    cores = []
    for core in current_machine().cores:
        cpus = tuple(c for c in core.cpus if c in allowed)
        if cpus:
            cores.append(AllowedCore(cpus, core.node))
    return tuple(cores)


def allowed_cpus() -> tuple[int, ...]:
    """Every CPU of the allowed cores, sorted."""
    return tuple(sorted(c for core in allowed_cores() for c in core.cpus))


def node_ids() -> tuple[int, ...]:
    """NUMA nodes that have at least one allowed CPU."""
    return tuple(sorted({core.node for core in allowed_cores() if core.node is not None}))

