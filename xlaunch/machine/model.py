"""The machine as plain frozen facts. Read once (see :mod:`.sysfs`), then only looked at.

Every field says where it comes from; ``<root>`` is ``XLAUNCH_FSROOT`` (default ``/``).
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

from xlaunch._records import factory, record

PERFORMANCE = "performance"
EFFICIENCY = "efficiency"
UNKNOWN_KIND = "unknown"


@record
class Cpu:
    """One logical CPU (``<root>/sys/devices/system/cpu/cpuN``)."""

    id: int
    online: bool                 # cpu/online list (cpu0 without an ``online`` file is online)
    package: Optional[int]       # topology/physical_package_id
    die: Optional[int]           # topology/die_id
    core_id: Optional[int]       # topology/core_id (unique only within a package)
    siblings: tuple[int, ...]    # topology/thread_siblings_list, self included
    node: Optional[int]          # the NUMA node whose cpulist names this CPU
    l3: Optional[int]            # index into Machine.l3_domains
    kind: str = UNKNOWN_KIND     # /sys/devices/cpu_core|cpu_atom/cpus on hybrid parts


@record
class Core:
    """A physical core: the online logical CPUs that are SMT siblings of each other."""

    index: int                   # position in Machine.cores (ordered by node, L3, package, core id)
    cpus: tuple[int, ...]        # online sibling CPUs, lowest first; cpus[0] is the "primary"
    package: Optional[int]
    node: Optional[int]
    l3: Optional[int]
    kind: str = UNKNOWN_KIND


@record
class Node:
    """A NUMA node (``<root>/sys/devices/system/node/nodeN``); memory-only nodes have no cpus."""

    id: int
    cpus: tuple[int, ...]                       # nodeN/cpulist
    distances: tuple[tuple[int, int], ...] = ()  # (other node id, distance) from nodeN/distance
    memory_kib: Optional[int] = None            # MemTotal from nodeN/meminfo


@record
class CacheDomain:
    """CPUs sharing one L3 (``cache/index*/level == 3``, ``shared_cpu_list``)."""

    index: int
    cpus: tuple[int, ...]
    size_kib: Optional[int] = None


@record
class Isa:
    """Instruction-set facts from ``<root>/proc/cpuinfo`` and, live, the kernel's AMX grant."""

    flags: frozenset[str] = frozenset()
    vendor: Optional[str] = None
    model_name: Optional[str] = None
    amx_permitted: Optional[bool] = None   # arch_prctl(ARCH_REQ_XCOMP_PERM); None: not asked/not live

    def has(self, flag: str) -> bool:
        return flag in self.flags


@record
class Library:
    """A runtime library found on disk, e.g. kind ``jemalloc`` at ``/usr/lib/.../libjemalloc.so.2``."""

    kind: str        # jemalloc | tcmalloc | tcmalloc_minimal | iomp | gomp | omp
    path: str
    source: str      # where it was found: venv, conda, LD_LIBRARY_PATH, ldconfig, multiarch, ...


@record
class Host:
    """Host settings that change performance (read by :mod:`.host`); ``unknown`` when unreadable."""

    thp_enabled: str = "unknown"    # sys/kernel/mm/transparent_hugepage/enabled: always | madvise | never
    thp_defrag: str = "unknown"     # .../transparent_hugepage/defrag: always | defer | defer+madvise | madvise | never
    governors: tuple[tuple[str, int], ...] = ()   # (cpuN/cpufreq/scaling_governor, CPUs), most first;
                                                  # "none": no cpufreq directory; (): no cpu directory
    numa_balancing: str = "unknown"  # proc/sys/kernel/numa_balancing: 0 off, 1 on, 2 tiering, 3 both
    smt_control: str = "unknown"     # sys/devices/system/cpu/smt/control: on | off | forceoff | notsupported | ...
    smt_active: Optional[bool] = None  # .../smt/active


@record
class Machine:
    """Everything xlaunch knows about the machine and this process's share of it."""

    root: str
    cpus: tuple[Cpu, ...]                   # every present CPU, online or not, by id
    cores: tuple[Core, ...]                 # physical cores with at least one online CPU
    nodes: tuple[Node, ...]                 # by id; one synthetic node 0 when there is no node/
    l3_domains: tuple[CacheDomain, ...]
    allowed_cpus: tuple[int, ...]           # sched_getaffinity, or Cpus_allowed_list under a root
    allowed_mems: tuple[int, ...]           # Mems_allowed_list (nodes with memory we may use)
    cpu_budget: Optional[float] = None      # cgroup v2 cpu.max / v1 cfs quota, in CPUs
    isolated_cpus: tuple[int, ...] = ()     # cpu/isolated (isolcpus=): online CPUs the scheduler leaves alone
    isa: Isa = factory(Isa)
    libraries: tuple[Library, ...] = ()
    notes: tuple[str, ...] = ()             # what could not be read and was assumed instead
    host: Host = factory(Host)  # THP, governor, NUMA balancing, SMT

    @property
    def online_cpus(self) -> tuple[int, ...]:
        return tuple(c.id for c in self.cpus if c.online)

    def cpu(self, cpu_id: int) -> Optional[Cpu]:
        for c in self.cpus:
            if c.id == cpu_id:
                return c
        return None

    def node(self, node_id: int) -> Optional[Node]:
        for n in self.nodes:
            if n.id == node_id:
                return n
        return None

    def core_of(self, cpu_id: int) -> Optional[Core]:
        for core in self.cores:
            if cpu_id in core.cpus:
                return core
        return None

    @property
    def is_hybrid(self) -> bool:
        return any(c.kind == EFFICIENCY for c in self.cores)

    def library(self, kind: str) -> Optional[Library]:
        """The first library found of ``kind`` (search order is preference order)."""
        for lib in self.libraries:
            if lib.kind == kind:
                return lib
        return None
