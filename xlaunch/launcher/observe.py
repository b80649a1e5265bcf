"""What an instance really ran with: libraries mapped, CPUs its threads ran on, memory per node.

The runner's whole use (single-threaded; no threads are started here)::

    observer = Observer(pid, mem_nodes=instance.mem_nodes)    # right after the instance started
    observer.poll()                       # every loop turn: samples once ``interval`` has passed
    timeout = min(timeout, observer.next_due - time.monotonic())   # optional: wake up for it
    observed = observer.observed          # an :class:`Observed`, merged over every sample
    warnings = compare(observed, instance.cpus, instance.mem_nodes, allocator, openmp)
    data = to_json(observed)              # the "observed" object of --summary-json
    row = cells(observed)                 # short texts for the end-of-run table

``allocator`` and ``openmp`` are the plan's choice (``Runtime.allocator``, ``Runtime.openmp``);
pass ``()`` as the CPUs of an unpinned (``bind == "none"``) instance. The last sample before
the leader exits is the final one: an exited process has no maps left to read.

:func:`sample` is one read of an instance's process tree, for other users.

Where each fact comes from (details and costs in ``docs/runner.md``, "What is observed"):

* the process tree: the leader, its descendants (``/proc/PID/task/TID/children``; psutil's
  ``children(recursive=True)`` when the kernel has no such file) and this process's children in
  the process group the leader created (orphans re-parented to the runner as subreaper);
* libraries: ``/proc/PID/maps`` paths named ``libjemalloc``, ``libtcmalloc[_minimal]``,
  ``libmimalloc``, ``libgomp``, ``libiomp5``, ``libomp``; ``LD_PRELOAD`` from psutil's ``environ()``
  decides which OpenMP runtime shadows the others;
* threads and CPUs: field 39 (``processor``, the CPU last run on) of ``/proc/PID/task/TID/stat``;
* memory per node: the ``N<node>=<pages>`` counts × ``kernelpagesize_kB`` of the anonymous
  mappings (heap, stacks, anonymous mmaps: where tensors live) in ``/proc/PID/numa_maps``.

Processes that end, turn zombie or refuse access in the middle of a read are skipped.
"""
from __future__ import annotations

import os
import re
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from xlaunch._records import record
from xlaunch.cpulist import format_cpulist

INTERVAL = 0.5                 # seconds between samples
MEMORY_INTERVAL = 5.0          # seconds between numa_maps reads (they walk page tables)
REMOTE_WARN_PCT = 10.0         # warn above this share of memory on other nodes ...
REMOTE_WARN_MIN_BYTES = 64 << 20   # ... when at least this much memory is remote

ALLOCATORS = ("jemalloc", "tcmalloc", "tcmalloc_minimal", "mimalloc")
OPENMP_OF_KIND = {"gomp": "gnu", "iomp": "intel", "omp": "llvm"}   # library kind -> runtime name
_SHADOWING_KINDS = ("iomp", "omp")   # export GOMP_*, __kmpc_* and omp_*: preloaded, they win all

_LIBRARY = re.compile(
    r"^lib(jemalloc|tcmalloc_minimal|tcmalloc|mimalloc|gomp|iomp5|omp)(?:[-_.][^/]*)?\.so(?:\.[\d.]+)?$"
)
_MAPPED_NAME = re.compile(r"/lib(?:jemalloc|tcmalloc|mimalloc|gomp|iomp5|omp)[^/\n]*$", re.M)
_DELETED = " (deleted)"
_NODE_PAGES = re.compile(r" N(\d+)=(\d+)")
_PAGE_KB = re.compile(r" kernelpagesize_kB=(\d+)")
_PROCESSOR_FIELD = 39          # 1-based field of /proc/PID/task/TID/stat


# --------------------------------------------------------------------------------------------
# parsers of recorded text (pure)


def library_kind(path: str) -> Optional[str]:
    """``jemalloc``, ``tcmalloc``, ``tcmalloc_minimal``, ``mimalloc``, ``gomp``, ``iomp``, ``omp``
    for a library file name or path (``libgomp-a34b3233.so.1`` is ``gomp``), else None."""
    match = _LIBRARY.match(os.path.basename(path))
    if match is None:
        return None
    kind = match.group(1)
    return "iomp" if kind == "iomp5" else kind


def mapped_libraries(maps_text: str) -> list[tuple[str, str]]:
    """``(kind, path)`` of the allocator and OpenMP libraries in a ``/proc/PID/maps`` text,
    each path once, in address order."""
    found: dict[str, str] = {}
    for match in _MAPPED_NAME.finditer(maps_text):   # the file name first: a fast literal scan
        line_start = maps_text.rfind("\n", 0, match.start()) + 1
        fields = maps_text[line_start:match.end()].split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5][:-len(_DELETED)] if fields[5].endswith(_DELETED) else fields[5]
        if path not in found:
            kind = library_kind(path)
            if kind is not None:
                found[path] = kind
    return [(kind, path) for path, kind in found.items()]


def anonymous_memory_by_node(numa_maps_text: str, page_size: int = 4096) -> dict[int, int]:
    """Bytes of resident anonymous memory per NUMA node in a ``/proc/PID/numa_maps`` text.

    File-backed mappings (``file=``: libraries, page cache, shared memory) are left out: their
    pages are shared with other processes and sit wherever the first reader put them. Private
    hugetlb memory (``file=/anon_hugepage``) is anonymous and counted.
    """
    by_node: dict[int, int] = {}
    for line in numa_maps_text.splitlines():
        if " N" not in line or (" file=" in line and " file=/anon_hugepage" not in line):
            continue
        size = _PAGE_KB.search(line)
        unit = int(size.group(1)) * 1024 if size else page_size
        for node, pages in _NODE_PAGES.findall(line):
            by_node[int(node)] = by_node.get(int(node), 0) + int(pages) * unit
    return by_node


def last_cpu(stat_text: str) -> Optional[int]:
    """The CPU a thread last ran on (``processor``) from its ``/proc/PID/task/TID/stat``;
    None for an exited (zombie/dead) thread or an unreadable line."""
    _, sep, rest = stat_text.rpartition(")")   # comm may hold spaces and parentheses
    fields = rest.split()
    if not sep or len(fields) < _PROCESSOR_FIELD - 2 or fields[0] in ("Z", "X", "x"):
        return None
    try:
        return int(fields[_PROCESSOR_FIELD - 3])
    except ValueError:
        return None


def preload_kinds(ld_preload: str) -> dict[str, str]:
    """``{path: kind}`` of the allocator/OpenMP libraries named in an ``LD_PRELOAD`` value."""
    out: dict[str, str] = {}
    for entry in re.split(r"[ :]+", ld_preload):
        kind = library_kind(entry) if entry else None
        if kind is not None:
            out[entry] = kind
    return out


def split_openmp(libraries: Sequence[tuple[str, str]], preloaded: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(active, shadowed)`` OpenMP library paths of one process.

    A preloaded Intel or LLVM runtime comes first in symbol lookup and defines the GNU
    (``GOMP_*``), Intel (``__kmpc_*``) and standard (``omp_*``) entry points, so every other
    runtime mapped next to it only sits there (torch's own libgomp under ``LD_PRELOAD=libiomp5``).
    A preloaded libgomp shadows only other libgomp copies. A preloaded path matches the same
    mapped path; a bare file name (found by the loader's search) the first mapped file of that name.
    """
    runtimes = [(kind, path) for kind, path in libraries if kind in OPENMP_OF_KIND]
    bare_names = {p for p in preloaded if "/" not in p}
    winners = [(kind, path) for kind, path in runtimes if path in preloaded] or \
              [(kind, path) for kind, path in runtimes if os.path.basename(path) in bare_names]
    if not winners:
        return [path for _, path in runtimes], []
    kind, winner = winners[0]
    shadowed = [path for other_kind, path in runtimes if path != winner
                and (kind in _SHADOWING_KINDS or other_kind == "gomp")]
    return [path for _, path in runtimes if path not in shadowed], shadowed


# --------------------------------------------------------------------------------------------
# one read of a process tree


@record
class ProcessSample:
    """One process of an instance, as read once."""

    pid: int
    libraries: tuple[tuple[str, str], ...] = ()     # (kind, path) mapped, see mapped_libraries
    openmp_active: tuple[str, ...] = ()             # OpenMP paths not shadowed (see split_openmp)
    openmp_shadowed: tuple[str, ...] = ()
    threads: tuple[tuple[int, int], ...] = ()       # (tid, CPU last run on)
    memory_by_node: Optional[tuple[tuple[int, int], ...]] = None   # anonymous bytes; None: not read


@record
class Sample:
    """One read of an instance's process tree (``processes[0]`` is the leader while it lives)."""

    pid: int
    time: float
    processes: tuple[ProcessSample, ...] = ()

    @property
    def memory_read(self) -> bool:
        return any(p.memory_by_node is not None for p in self.processes)


def sample(pid: int, *, memory: bool = True) -> Sample:
    """Read the instance led by ``pid`` now. Never raises for processes that vanish."""
    return _read_sample(pid, memory, {})


def _read_sample(pid: int, memory: bool, preload_cache: dict[int, dict[str, str]]) -> Sample:
    import psutil

    page_size = os.sysconf("SC_PAGE_SIZE")
    processes = []
    for member in _members(pid, psutil):
        read = _read_process(member, memory, page_size, preload_cache, psutil)
        if read is not None:
            processes.append(read)
    return Sample(pid=pid, time=time.monotonic(), processes=tuple(processes))


def _read_process(pid: int, memory: bool, page_size: int,
                  preload_cache: dict[int, dict[str, str]], psutil: Any) -> Optional[ProcessSample]:
    try:
        maps = _read(f"/proc/{pid}/maps")
        if not maps:                       # zombie or kernel thread: no address space
            return None
        libraries = mapped_libraries(maps)
        active = [p for k, p in libraries if k in OPENMP_OF_KIND]
        shadowed: list[str] = []
        if len(active) > 1:
            preloaded = preload_cache.get(pid)
            if preloaded is None:
                try:
                    env = psutil.Process(pid).environ()
                except psutil.AccessDenied:
                    env = {}
                preloaded = preload_cache[pid] = preload_kinds(env.get("LD_PRELOAD", ""))
            active, shadowed = split_openmp(libraries, preloaded)
        threads = []
        for tid in _list_ints(f"/proc/{pid}/task"):
            try:
                cpu = last_cpu(_read(f"/proc/{pid}/task/{tid}/stat"))
            except OSError:
                continue                   # the thread ended
            if cpu is not None:
                threads.append((tid, cpu))
        by_node = None
        if memory:
            by_node = tuple(sorted(anonymous_memory_by_node(_read(f"/proc/{pid}/numa_maps"), page_size).items()))
    except (OSError, psutil.NoSuchProcess):
        return None
    if not threads:
        return None
    return ProcessSample(pid=pid, libraries=tuple(libraries), openmp_active=tuple(active),
                         openmp_shadowed=tuple(shadowed), threads=tuple(threads), memory_by_node=by_node)


def _members(pid: int, psutil: Any) -> list[int]:
    """The leader, its descendants, and this process's children in the process group ``pid``
    (orphans re-parented to this process as a subreaper, also after the leader is gone)."""
    roots = [pid]
    if _has_children_files():
        roots += [child for child in _children(os.getpid()) if child != pid and _pgid(child) == pid]
    members: list[int] = []
    for root in roots:
        members.extend(_tree(root, psutil))
    return list(dict.fromkeys(members))


def _tree(pid: int, psutil: Any) -> list[int]:
    """``pid`` and its descendants, parents first."""
    if not _has_children_files():
        try:
            return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return [pid]
    out, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo.extend(_children(current))
    return out


def _children(pid: int) -> list[int]:
    """Direct children, from every thread's ``task/TID/children`` (a thread may fork)."""
    kids: list[int] = []
    for tid in _list_ints(f"/proc/{pid}/task"):
        try:
            kids.extend(int(k) for k in _read(f"/proc/{pid}/task/{tid}/children").split())
        except OSError:
            continue                       # the thread or process ended
    return kids


_CHILDREN_FILES: list[bool] = []


def _has_children_files() -> bool:
    """Whether the kernel has ``/proc/PID/task/TID/children`` (CONFIG_PROC_CHILDREN)."""
    if not _CHILDREN_FILES:
        _CHILDREN_FILES.append(os.path.exists(f"/proc/self/task/{os.getpid()}/children"))
    return _CHILDREN_FILES[0]


def _pgid(pid: int) -> Optional[int]:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _read(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read().decode("utf-8", "replace")


def _list_ints(path: str) -> list[int]:
    try:
        return [int(name) for name in os.listdir(path) if name.isdigit()]
    except OSError:
        return []


# --------------------------------------------------------------------------------------------
# merged over a run


@record
class Observed:
    """What an instance ran with, merged over every sample."""

    samples: int = 0
    processes: int = 0                                   # most processes seen at once
    threads: int = 0                                     # most threads seen at once (all processes)
    thread_cpus: tuple[int, ...] = ()                    # every CPU any thread was seen on
    cpus_by_thread: tuple[tuple[int, tuple[int, ...]], ...] = ()   # (tid, CPUs seen)
    libraries: tuple[tuple[str, str], ...] = ()          # (kind, path) ever mapped, leader first
    openmp_active: tuple[str, ...] = ()                  # OpenMP paths in use (not shadowed)
    openmp_shadowed: tuple[str, ...] = ()                # mapped but shadowed by a preloaded one
    openmp_conflicts: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (pid, 2+ active OpenMP paths)
    memory_by_node: Optional[tuple[tuple[int, int], ...]] = None    # anonymous bytes, last read
    mem_nodes: tuple[int, ...] = ()                      # the instance's (local) memory nodes

    @property
    def allocator(self) -> Optional[str]:
        """The first allocator library mapped (leader first), ``glibc`` if none, None if unread."""
        for kind, _ in self.libraries:
            if kind in ALLOCATORS:
                return kind
        return "glibc" if self.samples and self.processes else None

    @property
    def openmp(self) -> tuple[str, ...]:
        """Runtime names (``gnu``, ``intel``, ``llvm``) of the OpenMP libraries in use."""
        kinds = dict(self.libraries_by_path)
        return tuple(dict.fromkeys(OPENMP_OF_KIND[kinds[p]] for p in self.openmp_active))

    @property
    def libraries_by_path(self) -> dict[str, str]:
        return {path: kind for kind, path in self.libraries}

    @property
    def memory_bytes(self) -> Optional[int]:
        return None if self.memory_by_node is None else sum(b for _, b in self.memory_by_node)

    def remote_bytes(self, mem_nodes: Optional[Iterable[int]] = None) -> Optional[int]:
        """Anonymous bytes on nodes outside ``mem_nodes`` (default: the instance's)."""
        local = set(self.mem_nodes if mem_nodes is None else mem_nodes)
        if not local or self.memory_by_node is None:
            return None
        return sum(b for node, b in self.memory_by_node if node not in local)

    def remote_memory_pct(self, mem_nodes: Optional[Iterable[int]] = None) -> Optional[float]:
        """Percent of anonymous memory outside ``mem_nodes``; None when unknown or no memory."""
        remote, total = self.remote_bytes(mem_nodes), self.memory_bytes
        if remote is None or not total:
            return None
        return round(100.0 * remote / total, 1)


class Observer:
    """Samples one instance from a single-threaded loop and merges the samples.

    ``poll()`` is cheap when nothing is due (one clock read); a sample of a torch process
    costs about 2 ms, plus 10 ms or more for ``numa_maps`` every ``memory_interval`` seconds.
    """

    def __init__(self, pid: int, mem_nodes: Sequence[int] = (), *, interval: float = INTERVAL,
                 memory_interval: float = MEMORY_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval <= 0 or memory_interval <= 0:
            raise ValueError("Observer: interval and memory_interval must be > 0")
        self.pid = pid
        self.mem_nodes = tuple(mem_nodes)
        self.interval = interval
        self.memory_interval = memory_interval
        self._clock = clock
        self.next_due = clock()
        self._next_memory = self.next_due
        self._preload: dict[int, dict[str, str]] = {}
        self._samples = 0
        self._processes = 0
        self._threads = 0
        self._cpus_by_thread: dict[int, set[int]] = {}
        self._libraries: dict[str, str] = {}
        self._active: dict[int, dict[str, None]] = {}
        self._shadowed: dict[str, None] = {}
        self._memory: Optional[tuple[tuple[int, int], ...]] = None

    def poll(self, now: Optional[float] = None, *, force: bool = False) -> bool:
        """Take a sample if one is due (or ``force``); True when it did."""
        now = self._clock() if now is None else now
        if not force and now < self.next_due:
            return False
        memory = force or now >= self._next_memory
        self.add(_read_sample(self.pid, memory, self._preload))
        self.next_due = now + self.interval
        if memory:
            self._next_memory = now + self.memory_interval
        return True

    def add(self, one: Sample) -> None:
        """Merge a sample (taken by :meth:`poll`, or built elsewhere)."""
        self._samples += 1
        self._processes = max(self._processes, len(one.processes))
        self._threads = max(self._threads, sum(len(p.threads) for p in one.processes))
        memory: dict[int, int] = {}
        for process in one.processes:
            for tid, cpu in process.threads:
                self._cpus_by_thread.setdefault(tid, set()).add(cpu)
            for kind, path in process.libraries:
                self._libraries.setdefault(path, kind)
            self._active.setdefault(process.pid, {}).update(dict.fromkeys(process.openmp_active))
            self._shadowed.update(dict.fromkeys(process.openmp_shadowed))
            for node, size in process.memory_by_node or ():
                memory[node] = memory.get(node, 0) + size
        if one.memory_read:
            self._memory = tuple(sorted(memory.items()))

    @property
    def observed(self) -> Observed:
        shadowed = [p for p in self._shadowed if not any(p in a for a in self._active.values())]
        active = dict.fromkeys(p for paths in self._active.values() for p in paths)
        return Observed(
            samples=self._samples,
            processes=self._processes,
            threads=self._threads,
            thread_cpus=tuple(sorted(set().union(*self._cpus_by_thread.values()))),
            cpus_by_thread=tuple((tid, tuple(sorted(cpus))) for tid, cpus in sorted(self._cpus_by_thread.items())),
            libraries=tuple((kind, path) for path, kind in self._libraries.items()),
            openmp_active=tuple(active),
            openmp_shadowed=tuple(shadowed),
            openmp_conflicts=tuple((pid, tuple(paths)) for pid, paths in self._active.items() if len(paths) > 1),
            memory_by_node=self._memory,
            mem_nodes=self.mem_nodes,
        )


# --------------------------------------------------------------------------------------------
# against the plan


def compare(observed: Observed, planned_cpus: Sequence[int], planned_mem_nodes: Sequence[int],
            planned_allocator: Optional[str], planned_openmp: Optional[str], *,
            remote_warn_pct: float = REMOTE_WARN_PCT,
            remote_warn_min_bytes: int = REMOTE_WARN_MIN_BYTES) -> list[str]:
    """One line per way the run differed from the plan; [] when nothing was observed.

    ``planned_allocator`` is the plan's allocator (``jemalloc``, ``tcmalloc``,
    ``tcmalloc_minimal``, ``mimalloc``; ``glibc``, ``default``, ``user`` or None: not checked);
    ``planned_openmp`` its runtime (``intel`` is checked to be mapped; ``gnu``/None are not,
    since a program that never imports torch maps no OpenMP at all).
    """
    if not observed.samples or not observed.processes:
        return []
    lines = []
    slice_ = set(planned_cpus)
    if slice_:
        outside = [(tid, cpus) for tid, cpus in observed.cpus_by_thread if not set(cpus) <= slice_]
        if outside:
            seen = sorted({c for _, cpus in outside for c in cpus} - slice_)
            lines.append(f"{len(outside)} of {len(observed.cpus_by_thread)} threads ran outside the planned "
                         f"CPUs {format_cpulist(sorted(slice_))} (seen on {format_cpulist(seen)})")
    if planned_allocator in ALLOCATORS and planned_allocator not in dict(observed.libraries).keys():
        lines.append(f"allocator {planned_allocator} was planned but never mapped "
                     f"(ran with {observed.allocator})")
    if planned_openmp == "intel" and not any(kind == "iomp" for kind, _ in observed.libraries):
        lines.append("Intel OpenMP (libiomp5) was planned but never mapped")
    kinds = observed.libraries_by_path
    for pid, paths in observed.openmp_conflicts:
        names = ", ".join(f"{OPENMP_OF_KIND[kinds[p]]} ({p})" for p in paths)
        lines.append(f"{len(paths)} OpenMP runtimes mapped in process {pid}: {names}; each keeps "
                     f"its own thread pool (oversubscription, pinning of one only)")
    mem_nodes = planned_mem_nodes if planned_mem_nodes else observed.mem_nodes
    remote, pct = observed.remote_bytes(mem_nodes), observed.remote_memory_pct(mem_nodes)
    if remote is not None and pct is not None and pct > remote_warn_pct and remote >= remote_warn_min_bytes:
        nodes = sorted(n for n, b in observed.memory_by_node or () if b and n not in set(mem_nodes))
        lines.append(f"{pct:.1f}% of its memory ({remote / 1048576:.0f} MiB) is on node(s) "
                     f"{format_cpulist(nodes)}, outside its memory nodes {format_cpulist(sorted(set(mem_nodes)))}")
    return lines


def cells(observed: Observed) -> dict[str, str]:
    """Short texts for the end-of-run table: allocator, OpenMP, threads, CPUs seen, remote memory
    (``-`` when nothing was observed or unknown)."""
    pct = observed.remote_memory_pct()
    seen = observed.samples > 0 and observed.processes > 0
    return {
        "allocator": observed.allocator or "-",
        "openmp": "+".join(observed.openmp) or ("none" if seen else "-"),
        "threads": str(observed.threads) if seen else "-",
        "cpus_seen": format_cpulist(observed.thread_cpus) or "-",
        "remote_mem": "-" if pct is None else f"{pct:.0f}%",
    }


def to_json(observed: Observed) -> dict[str, Any]:
    """JSON-ready data for ``--summary-json``; unknowns are null."""
    kinds = observed.libraries_by_path
    return {
        "allocator": observed.allocator,
        "openmp": list(observed.openmp),
        "threads": observed.threads,
        "thread_cpus": list(observed.thread_cpus),
        "remote_memory_pct": observed.remote_memory_pct(),
        "processes": observed.processes,
        "samples": observed.samples,
        "libraries": [{"kind": kind, "path": path} for kind, path in observed.libraries],
        "openmp_shadowed": [{"runtime": OPENMP_OF_KIND[kinds[p]], "path": p} for p in observed.openmp_shadowed],
        "openmp_conflicts": [{"pid": pid, "runtimes": [OPENMP_OF_KIND[kinds[p]] for p in paths],
                              "paths": list(paths)} for pid, paths in observed.openmp_conflicts],
        "memory_mib_by_node": None if observed.memory_by_node is None else
        {str(node): round(size / 1048576, 1) for node, size in observed.memory_by_node},
        "mem_nodes": list(observed.mem_nodes),
    }
