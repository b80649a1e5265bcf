"""The CPUs this process may use, grouped by physical core, from xlaunch's machine model.

The one place the runtime reads the machine: everything else asks :func:`allowed_cores`.
Under ``xlaunch``, ``taskset`` or a cpuset the machine's ``allowed_cpus`` is the process's
affinity, so a default pool is exactly the instance's share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AllowedCore:
    """A physical core with at least one CPU this process may use."""

    cpus: tuple[int, ...]     # the allowed SMT siblings, lowest first; cpus[0] is the primary
    node: Optional[int]       # NUMA node, None when unknown


def allowed_cores() -> tuple[AllowedCore, ...]:
    """Allowed physical cores in machine order (by node, L3, package, core).

    The machine (and so the allowed set) is read once per process, on first use, by
    :func:`xlaunch.launcher.machine.current_machine`; a later ``taskset`` of the running
    process is not seen until ``xlaunch.launcher.machine.clear_cache()``.
    """
    from xlaunch.launcher.machine import current_machine

    machine = current_machine()
    allowed = set(machine.allowed_cpus)
    cores = []
    for core in machine.cores:
        cpus = tuple(c for c in core.cpus if c in allowed)
        if cpus:
            cores.append(AllowedCore(cpus, core.node))
    return tuple(cores)


def allowed_cpus() -> tuple[int, ...]:
    """Every CPU this process may use, sorted."""
    return tuple(sorted(c for core in allowed_cores() for c in core.cpus))


def node_ids() -> tuple[int, ...]:
    """NUMA nodes that have at least one allowed CPU."""
    return tuple(sorted({core.node for core in allowed_cores() if core.node is not None}))

