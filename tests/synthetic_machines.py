"""Synthetic :class:`Machine` objects for planner and CLI tests (``from synthetic_machines import ...``).

``synthetic_machine`` lays out ``nodes x l3_per_node x cores_per_l3`` physical cores with ``smt``
threads each, numbered like Linux does on big x86 servers (``+N``: the second thread of core k is
CPU k + ncores) or like many VMs (``adjacent``: 0/1, 2/3, ...).
"""
from __future__ import annotations

from typing import Iterable, Optional

from xlaunch.machine.model import (
    EFFICIENCY,
    PERFORMANCE,
    UNKNOWN_KIND,
    CacheDomain,
    Core,
    Cpu,
    Library,
    Machine,
    Node,
)

LIBS_ALL = (
    Library("jemalloc", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "multiarch"),
    Library("tcmalloc_minimal", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "multiarch"),
    Library("iomp", "/venv/lib/libiomp5.so", "venv"),
    Library("gomp", "/usr/lib/x86_64-linux-gnu/libgomp.so.1", "multiarch"),
)


def synthetic_machine(
    nodes: int = 2,
    l3_per_node: int = 1,
    cores_per_l3: int = 4,
    smt: int = 2,
    numbering: str = "plus_n",
    allowed: Optional[Iterable[int]] = None,
    offline: Iterable[int] = (),
    efficiency_cores: int = 0,
    memory_only_nodes: int = 0,
    allowed_mems: Optional[Iterable[int]] = None,
    libraries: tuple[Library, ...] = LIBS_ALL,
    cpu_budget: Optional[float] = None,
) -> Machine:
    """A machine with the given shape; ``efficiency_cores`` (single-threaded) go last, on node 0."""
    ncores_big = nodes * l3_per_node * cores_per_l3
    offline = set(offline)
    # core k -> (node, l3, threads)
    layout: list[tuple[int, int, list[int]]] = []
    for k in range(ncores_big):
        node = k // (l3_per_node * cores_per_l3)
        l3 = k // cores_per_l3
        if numbering == "adjacent":
            threads = [k * smt + t for t in range(smt)]
        else:
            threads = [k + t * ncores_big for t in range(smt)]
        layout.append((node, l3, threads))
    first_e = ncores_big * smt
    for e in range(efficiency_cores):
        layout.append((0, nodes * l3_per_node, [first_e + e]))
    cpus: list[Cpu] = []
    cores: list[Core] = []
    for k, (node, l3, threads) in enumerate(layout):
        kind = UNKNOWN_KIND
        if efficiency_cores:
            kind = EFFICIENCY if k >= ncores_big else PERFORMANCE
        for t in threads:
            cpus.append(Cpu(t, t not in offline, 0, 0, k, tuple(threads), node, l3, kind))
        online = tuple(t for t in threads if t not in offline)
        if online:
            cores.append(Core(len(cores), online, 0, node, l3, kind))
    cpus.sort(key=lambda c: c.id)
    cores.sort(key=lambda c: (c.node, c.l3, c.cpus[0]))
    cores = [Core(i, c.cpus, c.package, c.node, c.l3, c.kind) for i, c in enumerate(cores)]
    node_objs = [
        Node(n, tuple(sorted(c.id for c in cpus if c.node == n))) for n in range(nodes)
    ] + [Node(nodes + m, ()) for m in range(memory_only_nodes)]
    l3_count = nodes * l3_per_node + (1 if efficiency_cores else 0)
    l3s = tuple(CacheDomain(i, tuple(sorted(c.id for c in cpus if c.l3 == i))) for i in range(l3_count))
    online_ids = [c.id for c in cpus if c.online]
    allowed_cpus = tuple(sorted(set(online_ids) & set(allowed))) if allowed is not None else tuple(online_ids)
    mems = tuple(allowed_mems) if allowed_mems is not None else tuple(n.id for n in node_objs)
    return Machine(
        root="/synthetic",
        cpus=tuple(cpus),
        cores=tuple(cores),
        nodes=tuple(node_objs),
        l3_domains=l3s,
        allowed_cpus=allowed_cpus,
        allowed_mems=mems,
        cpu_budget=cpu_budget,
        libraries=libraries,
    )
