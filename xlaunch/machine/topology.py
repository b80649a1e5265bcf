"""CPU, core, NUMA node and L3 topology from ``<root>/sys/devices/system/{cpu,node}``.

Reads as few files as the kernel allows: the ``online``/``present`` lists, then one
``topology/`` read per SMT group and one ``cache/`` read per L3 domain (siblings and sharers
are covered by the first member read). The kernel removes ``topology/`` and ``cache/`` of
offline CPUs and drops them from every sibling, shared-cache and node list.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Iterable, Optional

from xlaunch._records import record
from xlaunch.cpulist import shown
from xlaunch.machine._files import (
    Notes,
    decimal,
    join,
    list_numbered,
    read_cpulist,
    read_int,
    read_text,
)
from xlaunch.machine.model import (
    EFFICIENCY,
    PERFORMANCE,
    UNKNOWN_KIND,
    CacheDomain,
    Core,
    Cpu,
    Node,
)

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
HYBRID_LISTS = (("sys/devices/cpu_core/cpus", PERFORMANCE), ("sys/devices/cpu_atom/cpus", EFFICIENCY))


@record
class Topology:
    cpus: tuple[Cpu, ...]
    cores: tuple[Core, ...]
    nodes: tuple[Node, ...]
    l3_domains: tuple[CacheDomain, ...]

    @property
    def online_cpus(self) -> tuple[int, ...]:
        return tuple(c.id for c in self.cpus if c.online)


@record(frozen=False)
class _Place:
    """Topology ids of one CPU as read from its ``topology/`` directory."""

    package: Optional[int] = None
    die: Optional[int] = None
    core_id: Optional[int] = None
    siblings: tuple[int, ...] = ()


def read_topology(root: str, notes: Notes, fallback_cpus: Iterable[int] = ()) -> Topology:
    """The machine's topology; ``fallback_cpus`` (e.g. this process's affinity) stands in for
    the CPU list when sysfs names no CPUs at all."""
    cpu_dir = join(root, CPU_DIR)
    present = _present_cpus(cpu_dir, notes)
    if not present:
        present = tuple(sorted(set(fallback_cpus)))
        notes.add(f"no CPUs listed under {cpu_dir}; assumed {len(present)} independent online CPUs")
        online: frozenset[int] = frozenset(present)
    else:
        online = _online_cpus(cpu_dir, present, notes)

    places = _read_places(cpu_dir, present, online, notes)
    l3_of, l3_domains = _read_l3(cpu_dir, present, online, notes)
    nodes, node_of = _read_nodes(root, online, notes)
    kind_of = _read_kinds(root, notes)

    cpus = tuple(
        Cpu(
            id=cpu,
            online=cpu in online,
            package=places[cpu].package,
            die=places[cpu].die,
            core_id=places[cpu].core_id,
            siblings=places[cpu].siblings,
            node=node_of.get(cpu),
            l3=l3_of.get(cpu),
            kind=kind_of.get(cpu, UNKNOWN_KIND),
        )
        for cpu in present
    )
    return Topology(cpus=cpus, cores=_group_cores(cpus), nodes=nodes, l3_domains=l3_domains)


def _present_cpus(cpu_dir: str, notes: Notes) -> tuple[int, ...]:
    present = read_cpulist(join(cpu_dir, "present"), notes)
    if present is None:
        present = tuple(list_numbered(cpu_dir, "cpu"))
        if present:
            notes.add(f"{cpu_dir}/present unreadable; used the cpuN directories")
    return present


def _online_cpus(cpu_dir: str, present: tuple[int, ...], notes: Notes) -> frozenset[int]:
    online = read_cpulist(join(cpu_dir, "online"), notes)
    if online is not None and set(online) & set(present):
        return frozenset(online) & frozenset(present)
    if online is None:
        notes.add(f"{cpu_dir}/online unreadable; used each cpuN/online (missing means online)")
    else:   # the kernel always has a CPU online: an empty list is a damaged file, not a machine
        notes.add(f"{cpu_dir}/online names no present CPU; used each cpuN/online (missing means online)")
    result = set()
    for cpu in present:
        flag = read_text(join(cpu_dir, f"cpu{cpu}/online"), notes=notes)
        if flag is None or flag == "1":
            result.add(cpu)
    if not result:
        notes.add("no cpuN/online says 1; assumed every present CPU online")
        return frozenset(present)
    return frozenset(result)


def _read_places(
    cpu_dir: str, present: tuple[int, ...], online: frozenset[int], notes: Notes
) -> dict[int, _Place]:
    """Package, die, core id and online SMT siblings, reading one member per sibling group."""
    places: dict[int, _Place] = {}
    for cpu in present:
        if cpu in places:
            continue
        topo = join(cpu_dir, f"cpu{cpu}/topology/")
        if cpu not in online:
            # The kernel drops topology/ of offline CPUs; use whatever is left.
            places[cpu] = _Place(
                read_int(topo + "physical_package_id", notes), read_int(topo + "die_id", notes),
                read_int(topo + "core_id", notes), (cpu,),
            )
            continue
        listed = read_cpulist(topo + "thread_siblings_list", notes)
        if listed is None:
            notes.add_cpu(cpu, "topology/thread_siblings_list missing; treated as its own core")
            listed = (cpu,)
        siblings = tuple(sorted((set(listed) & online) | {cpu}))
        package = read_int(topo + "physical_package_id", notes)
        if package is None:
            notes.add_cpu(cpu, "topology/physical_package_id missing; package unknown")
        place = _Place(package, read_int(topo + "die_id", notes), read_int(topo + "core_id", notes), siblings)
        for sibling in siblings:
            if sibling not in places:
                places[sibling] = place
    return places


def _read_l3(
    cpu_dir: str, present: tuple[int, ...], online: frozenset[int], notes: Notes
) -> tuple[dict[int, int], tuple[CacheDomain, ...]]:
    """L3 domains (``cache/index*/level == 3``), one read per domain."""
    domains: list[tuple[tuple[int, ...], Optional[int]]] = []
    member_of: dict[int, int] = {}
    l3_index: Optional[str] = None          # e.g. "index3"; the same name on every CPU in practice
    for cpu in present:
        if cpu not in online or cpu in member_of:
            continue
        cache = join(cpu_dir, f"cpu{cpu}/cache/")
        if l3_index is None or read_text(cache + l3_index + "/level", notes=notes) != "3":
            l3_index = _find_l3_index(cache, notes)
            if l3_index is None:
                continue
        shared = read_cpulist(cache + l3_index + "/shared_cpu_list", notes)
        if shared is None:
            notes.add_cpu(cpu, f"{l3_index}/shared_cpu_list missing; L3 sharing unknown")
            shared = (cpu,)
        members = tuple(sorted((set(shared) & online) | {cpu}))
        size = _size_kib(read_text(cache + l3_index + "/size", notes=notes))
        position = len(domains)
        domains.append((members, size))
        for member in members:
            member_of.setdefault(member, position)
    if not domains and online:
        notes.add("no L3 cache information under cpuN/cache/; L3 domains unknown")
    # Index domains by their first CPU so the numbering does not depend on reading order.
    order = sorted(range(len(domains)), key=lambda i: domains[i][0])
    renumber = {old: new for new, old in enumerate(order)}
    result = tuple(
        CacheDomain(index=new, cpus=domains[old][0], size_kib=domains[old][1])
        for new, old in enumerate(order)
    )
    return {cpu: renumber[pos] for cpu, pos in member_of.items()}, result


def _find_l3_index(cache_dir: str, notes: Notes) -> Optional[str]:
    for index in list_numbered(cache_dir, "index"):
        name = f"index{index}"
        if read_text(cache_dir + name + "/level", notes=notes) == "3":
            return name
    return None


def _size_kib(text: Optional[str]) -> Optional[int]:
    """``"32768K"`` -> 32768; sysfs cache sizes are in K (M/G accepted for recorded oddities)."""
    if not text:
        return None
    scale = {"K": 1, "M": 1024, "G": 1024 * 1024}.get(text[-1].upper())
    number = decimal(text[:-1] if scale else text)
    if number is None:
        return None
    return number * scale if scale else number // 1024


def _read_nodes(
    root: str, online: frozenset[int], notes: Notes
) -> tuple[tuple[Node, ...], dict[int, int]]:
    node_dir = join(root, NODE_DIR)
    if not os.path.isdir(node_dir):
        notes.add("no sys/devices/system/node (kernel without NUMA); assumed one node 0 with all CPUs")
        cpus = tuple(sorted(online))
        memory = _meminfo_total(read_text(join(root, "proc/meminfo"), notes=notes))
        return (Node(id=0, cpus=cpus, distances=((0, 10),), memory_kib=memory),), {c: 0 for c in cpus}

    node_ids = read_cpulist(join(node_dir, "online"), notes)
    listed = list_numbered(node_dir, "node")
    if node_ids is None:
        node_ids = tuple(listed)
        notes.add("node/online unreadable; used the nodeN directories")
    else:
        missing = [n for n in node_ids if n not in listed]
        if missing:
            notes.add(f"node/online names nodes without a directory: {missing}; skipped")
            node_ids = tuple(n for n in node_ids if n in listed)

    nodes = []
    node_of: dict[int, int] = {}
    for node in node_ids:
        base = join(node_dir, f"node{node}/")
        cpus = read_cpulist(base + "cpulist", notes)
        if cpus is None:
            notes.add(f"node{node}/cpulist missing; node assumed to have no CPUs")
            cpus = ()
        cpus = tuple(c for c in cpus if c in online)
        for cpu in cpus:
            node_of.setdefault(cpu, node)
        nodes.append(Node(
            id=node,
            cpus=cpus,
            distances=_distances(read_text(base + "distance", notes=notes), node_ids, node, notes),
            memory_kib=_meminfo_total(read_text(base + "meminfo", notes=notes)),
        ))
    if not nodes:
        notes.add("no readable NUMA node; assumed one node 0 with all CPUs")
        cpus = tuple(sorted(online))
        return (Node(id=0, cpus=cpus),), {c: 0 for c in cpus}
    stray = sorted(online - set(node_of))
    if stray:
        notes.add(f"online CPUs in no node's cpulist: {stray}")
    _check_node_memory(root, nodes, notes)
    return tuple(nodes), node_of


def _check_node_memory(root: str, nodes: list[Node], notes: Notes) -> None:
    """A note when the nodes' ``MemTotal`` add up to much less than ``proc/meminfo``'s.

    Seen on both VMs this project ran on (a 2-vCPU EPYC VM: 16.7 of 23.5 GiB; the 16-core Xeon VM
    of tests/machines/spr16: 4.3 of 125.9 GiB): the per-node counters leave part of the memory
    out, so a node's size there is a lower bound, not the memory its instances can use.
    """
    sizes = [n.memory_kib for n in nodes]
    if not sizes or any(size is None for size in sizes):
        return
    total = _meminfo_total(read_text(join(root, "proc/meminfo")))
    counted = sum(size for size in sizes if size is not None)
    if total and counted < 0.9 * total:
        notes.add(f"the nodes' meminfo count {counted / 1048576:.1f} GiB, proc/meminfo "
                  f"{total / 1048576:.1f} GiB: node memory sizes are lower bounds on this kernel")


def _distances(
    text: Optional[str], node_ids: tuple[int, ...], node: int, notes: Notes
) -> tuple[tuple[int, int], ...]:
    """``nodeN/distance`` lists one distance per online node, in node id order."""
    if text is None:
        notes.add(f"node{node}/distance missing; distances unknown")
        return ()
    values = [decimal(v) for v in text.split()]
    if len(values) != len(node_ids) or None in values:
        notes.add(f"node{node}/distance {shown(text)} does not match nodes {list(node_ids)}; ignored")
        return ()
    return tuple(zip(node_ids, values))


def _meminfo_total(text: Optional[str]) -> Optional[int]:
    """MemTotal in KiB from ``meminfo`` (``Node 0 MemTotal: 1234 kB`` or ``MemTotal: ...``)."""
    if text is None:
        return None
    for line in text.splitlines():
        head, sep, value = line.partition(":")
        if sep and head.split()[-1:] == ["MemTotal"]:
            return decimal(value.split()[0] if value.split() else None)
    return None


def _read_kinds(root: str, notes: Notes) -> dict[int, str]:
    """Hybrid core types from the PMU device lists ``cpu_core/cpus`` and ``cpu_atom/cpus``."""
    kinds: dict[int, str] = {}
    for relative, kind in HYBRID_LISTS:
        cpus = read_cpulist(join(root, relative), notes)
        for cpu in cpus or ():
            kinds[cpu] = kind
    return kinds


def _group_cores(cpus: tuple[Cpu, ...]) -> tuple[Core, ...]:
    """Physical cores (online SMT groups) ordered by node, L3 domain, package, core id."""
    by_id = {c.id: c for c in cpus}
    groups: list[tuple[Cpu, tuple[int, ...]]] = []
    seen: set[int] = set()
    for cpu in cpus:
        if cpu.online and cpu.id not in seen:
            # Every online CPU lands in exactly one core, even if sibling files disagree.
            members = tuple(sorted({s for s in cpu.siblings if s in by_id and by_id[s].online
                                    and s not in seen} | {cpu.id}))
            seen.update(members)
            groups.append((by_id[members[0]], members))

    def key(primary: Cpu) -> tuple:
        return (_last(primary.node), _last(primary.l3), _last(primary.package),
                _last(primary.die), _last(primary.core_id), primary.id)

    groups.sort(key=lambda group: key(group[0]))
    return tuple(
        Core(index=i, cpus=members, package=p.package, node=p.node, l3=p.l3, kind=p.kind)
        for i, (p, members) in enumerate(groups)
    )


def _last(value: Optional[int]) -> tuple[int, int]:
    """Sort key putting unknown (None) after every known id."""
    return (1, 0) if value is None else (0, value)
