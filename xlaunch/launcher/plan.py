"""What the launcher will do, as data: a :class:`Plan` of :class:`Instance` s.

The planner (``plan()``, a pure function of Options and Machine) builds these; the runner
only reads them. ``Plan.to_json()`` is the ``--dry-run --json`` schema.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Instance:
    """One process to start: where it runs, with what environment, and what it executes."""

    index: int
    cpus: tuple[int, ...]
    mem_nodes: tuple[int, ...]
    env: dict[str, str]          # the complete environment of the child
    argv: tuple[str, ...]        # what is exec'd; includes numactl/taskset when bind == those
    bind: str = "native"         # native: runner pins with sched_setaffinity + set_mempolicy
    membind: str = "bind"        # bind | preferred | interleave | none (native binding only)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "cpus": list(self.cpus),
            "mem_nodes": list(self.mem_nodes),
            "env": dict(self.env),
            "argv": list(self.argv),
            "bind": self.bind,
            "membind": self.membind,
        }


@dataclass(frozen=True)
class Plan:
    instances: tuple[Instance, ...]
    idle_cpus: tuple[int, ...] = ()          # allowed CPUs no instance uses
    warnings: tuple[str, ...] = ()
    env_set: dict[str, str] = field(default_factory=dict)     # what xlaunch added (all instances alike)
    env_kept: dict[str, str] = field(default_factory=dict)    # user's values xlaunch did not override
    machine_summary: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "instances": [i.to_json() for i in self.instances],
            "idle_cpus": list(self.idle_cpus),
            "warnings": list(self.warnings),
            "env_set": dict(self.env_set),
            "env_kept": dict(self.env_kept),
            "machine": dict(self.machine_summary),
        }
