"""What the launcher will do, as data: a :class:`Plan` of :class:`Instance` s.

:func:`xlaunch.launcher.plan.planner.plan` (a pure function of Options and Machine) builds them,
:mod:`.reserve` and the distributed front refine them, the runner only reads them.
``Plan.to_json()`` is the ``--dry-run --json`` schema. A module of their own, which imports no
other planning module, so that everything planning can name them without an import cycle.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")

from xlaunch._records import factory, record

if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Mapping, Optional


@record
class Instance:
    """One process to start: where it runs, with what environment, and what it executes."""

    index: int
    cpus: tuple[int, ...]
    mem_nodes: tuple[int, ...]
    env: dict[str, str]          # the complete environment of the child
    argv: tuple[str, ...]        # what is exec'd; includes numactl/taskset when bind == those
    bind: str = "native"         # native: runner pins with sched_setaffinity + set_mempolicy
    membind: str = "bind"        # bind | preferred | interleave | none (native binding only)

    def to_json(self, inherited: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
        env = dict(self.env)
        unset: list[str] = []
        if inherited is not None:
            env = {k: v for k, v in self.env.items() if inherited.get(k) != v}
            unset = sorted(k for k in inherited if k not in self.env)
        return {
            "index": self.index,
            "cpus": list(self.cpus),
            "mem_nodes": list(self.mem_nodes),
            "env": env,
            **({"env_unset": unset} if unset else {}),
            "argv": list(self.argv),
            "bind": self.bind,
            "membind": self.membind,
        }


@record
class ImportServer:
    """``--share-imports``: one process that imports ``modules`` once, then forks the instances
    ``indices`` from itself (:mod:`xlaunch.launcher.plan.shared` decides, the runner starts it)."""

    modules: tuple[str, ...]
    indices: tuple[int, ...]     # the instances forked from it
    cpus: tuple[int, ...]        # where it imports: its instances' CPUs together
    mem_nodes: tuple[int, ...]
    membind: str                 # its instances' memory policy, so the shared pages land on their nodes
    env: dict[str, str]          # its instances' common environment, per-instance placement left out

    def to_json(self) -> dict[str, Any]:
        return {"modules": list(self.modules), "instances": list(self.indices), "cpus": list(self.cpus),
                "mem_nodes": list(self.mem_nodes), "membind": self.membind}


@record
class Plan:
    instances: tuple[Instance, ...]
    idle_cpus: tuple[int, ...] = ()          # allowed CPUs no instance uses
    warnings: tuple[str, ...] = ()
    env_set: dict[str, str] = factory(dict)     # what xlaunch added (all instances alike)
    env_kept: dict[str, str] = factory(dict)    # user's values xlaunch did not override
    machine_summary: dict[str, Any] = factory(dict)
    allocator: str = "default"               # jemalloc | tcmalloc | tcmalloc_minimal | glibc | default | user
    openmp: str = "gnu"                      # gnu | intel | llvm (the user's preloaded libomp)
    kernel_report: bool = False              # instances print oneDNN's verbose lines: take them out, summarise
    import_servers: tuple[ImportServer, ...] = ()   # --share-imports: the processes instances are forked from

    def to_json(self, inherited: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
        """The plan as JSON. With ``inherited`` (the user's environment), each instance's ``env``
        lists only what xlaunch changed, and ``env_unset`` what it removed: the rest of the
        user's environment (tokens, keys) is never printed."""
        return {
            "allocator": self.allocator,
            "openmp": self.openmp,
            "instances": [i.to_json(inherited) for i in self.instances],
            "idle_cpus": list(self.idle_cpus),
            "warnings": list(self.warnings),
            "env_set": dict(self.env_set),
            "env_kept": dict(self.env_kept),
            "machine": dict(self.machine_summary),
            **({"import_servers": [s.to_json() for s in self.import_servers]} if self.import_servers else {}),
        }
