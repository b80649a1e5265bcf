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

The reads themselves are :mod:`.procfs`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional, Sequence

from xlaunch._records import record
from xlaunch.cpulist import format_cpulist
from xlaunch.launcher.observe.procfs import ALLOCATORS, OPENMP_OF_KIND, Sample, read_sample

INTERVAL = 0.5                 # seconds between samples
MEMORY_INTERVAL = 5.0          # seconds between numa_maps reads (they walk page tables)
REMOTE_WARN_PCT = 10.0         # warn above this share of memory on other nodes ...
REMOTE_WARN_MIN_BYTES = 64 << 20   # ... when at least this much memory is remote

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
    files_by_node: Optional[tuple[tuple[str, tuple[tuple[int, int], ...]], ...]] = None   # mapped data files

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

    def remote_bytes(self, mem_nodes: Optional[Iterable[int]] = None) -> Optional[int]:
        """Anonymous bytes on nodes outside ``mem_nodes`` (default: the instance's)."""
        return _remote(self.memory_by_node, self._local(mem_nodes))

    def remote_memory_pct(self, mem_nodes: Optional[Iterable[int]] = None) -> Optional[float]:
        """Percent of anonymous memory outside ``mem_nodes``; None when unknown or no memory."""
        return _share(self.memory_by_node, self._local(mem_nodes))

    @property
    def file_bytes_by_node(self) -> Optional[tuple[tuple[int, int], ...]]:
        """The mapped data files' resident bytes per node, all files together."""
        if self.files_by_node is None:
            return None
        sums: dict[int, int] = {}
        for _, nodes in self.files_by_node:
            for node, size in nodes:
                sums[node] = sums.get(node, 0) + size
        return tuple(sorted(sums.items()))

    def remote_file_bytes(self, mem_nodes: Optional[Iterable[int]] = None) -> Optional[int]:
        """Resident bytes of mapped data files (:func:`~.procfs.mapped_file_memory_by_node`) on nodes outside
        ``mem_nodes`` (default: the instance's)."""
        return _remote(self.file_bytes_by_node, self._local(mem_nodes))

    def remote_file_pct(self, mem_nodes: Optional[Iterable[int]] = None) -> Optional[float]:
        """Percent of the mapped data files' resident pages outside ``mem_nodes``; None when unknown or none."""
        return _share(self.file_bytes_by_node, self._local(mem_nodes))

    def _local(self, mem_nodes: Optional[Iterable[int]]) -> set[int]:
        return set(self.mem_nodes if mem_nodes is None else mem_nodes)


def _remote(by_node: Optional[tuple[tuple[int, int], ...]], local: set[int]) -> Optional[int]:
    """Bytes of ``by_node`` outside ``local``; None when either is unknown."""
    if not local or by_node is None:
        return None
    return sum(b for node, b in by_node if node not in local)


def _share(by_node: Optional[tuple[tuple[int, int], ...]], local: set[int]) -> Optional[float]:
    """Percent of ``by_node``'s bytes outside ``local``; None when unknown or nothing."""
    remote = _remote(by_node, local)
    total = None if by_node is None else sum(b for _, b in by_node)
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
        self._files: Optional[tuple[tuple[str, tuple[tuple[int, int], ...]], ...]] = None

    def poll(self, now: Optional[float] = None, *, force: bool = False) -> bool:
        """Take a sample if one is due (or ``force``); True when it did."""
        now = self._clock() if now is None else now
        if not force and now < self.next_due:
            return False
        memory = force or now >= self._next_memory
        self.add(read_sample(self.pid, memory, self._preload))
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
        files: dict[str, dict[int, int]] = {}       # a file's pages are shared: the most any process has mapped
        for process in one.processes:
            for path, nodes in process.files_by_node or ():
                seen = files.setdefault(path, {})
                for node, size in nodes:
                    seen[node] = max(seen.get(node, 0), size)
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
            self._files = tuple((path, tuple(sorted(nodes.items()))) for path, nodes in sorted(files.items()))

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
            files_by_node=self._files,
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
    ``planned_openmp`` its runtime (``intel`` and ``llvm`` are checked to be mapped; ``gnu``/None are not,
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
    if planned_openmp == "llvm" and not any(kind == "omp" for kind, _ in observed.libraries):
        lines.append("LLVM OpenMP (libomp) was planned but never mapped")
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
    remote, pct = observed.remote_file_bytes(mem_nodes), observed.remote_file_pct(mem_nodes)
    if remote is not None and pct is not None and pct > remote_warn_pct and remote >= remote_warn_min_bytes:
        local = set(mem_nodes)
        away = [(path, nodes) for path, nodes in observed.files_by_node or () if any(n not in local for n, _ in nodes)]
        names = ", ".join(path.rsplit("/", 1)[-1] for path, _ in away[:3]) + (", ..." if len(away) > 3 else "")
        nodes = sorted({n for _, per_node in away for n, b in per_node if b and n not in local})
        lines.append(f"{pct:.1f}% of the pages of its mapped files ({remote / 1048576:.0f} MiB of {names}) are on "
                     f"node(s) {format_cpulist(nodes)}, outside its memory nodes {format_cpulist(sorted(local))}: "
                     "a file's pages stay where its first reader put them (the page cache is shared); a copy "
                     "per node keeps them local (xlaunch.node_copies; xlaunch.llm's node_copy=True)")
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
        "remote_file_pct": observed.remote_file_pct(),
        "mapped_files_mib_by_node": None if observed.files_by_node is None else
        {path: {str(node): round(size / 1048576, 1) for node, size in nodes} for path, nodes in observed.files_by_node},
    }
