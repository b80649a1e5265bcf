"""One read of an instance's process tree from ``/proc``: libraries mapped, the CPU each thread
last ran on, anonymous memory per NUMA node. Pure parsers of the ``/proc`` texts, and
:func:`sample` to read them (processes that end or refuse access mid-read are skipped).

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
"""
from __future__ import annotations

import os
import re
import time
from typing import Any, Optional, Sequence

from xlaunch._records import record


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
_FILE = re.compile(r" file=(\S+)")
_SHARED_LIBRARY = re.compile(r"\.so(\.[0-9]+)*$")
MAPPED_FILE_MIN_BYTES = 16 << 20     # data files mapped with less resident than this are left out
_PROCESSOR_FIELD = 39          # 1-based field of /proc/PID/task/TID/stat
_FLAGS_FIELD = 9               # 1-based field of /proc/PID/stat: the kernel's PF_* flags
_PF_EXITING = 0x4              # set by do_exit, before the thread lets go of the address space


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


def _bytes_by_node(numa_maps_line: str, page_size: int) -> list[tuple[int, int]]:
    """``(node, bytes)`` of one ``numa_maps`` entry: ``N<node>=<pages>`` x ``kernelpagesize_kB`` (else ``page_size``)."""
    size = _PAGE_KB.search(numa_maps_line)
    unit = int(size.group(1)) * 1024 if size else page_size
    return [(int(node), int(pages) * unit) for node, pages in _NODE_PAGES.findall(numa_maps_line)]


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
        for node, size in _bytes_by_node(line, page_size):
            by_node[node] = by_node.get(node, 0) + size
    return by_node


def mapped_file_memory_by_node(numa_maps_text: str, page_size: int = 4096,
                               min_bytes: int = MAPPED_FILE_MIN_BYTES) -> dict[str, dict[int, int]]:
    """Resident bytes per NUMA node of each data file mapped (a model's weights, a packed file, a
    ``/dev/shm`` segment), by path, for files with at least ``min_bytes`` resident.

    Shared libraries (``*.so``, ``*.so.N``) and ``/anon_hugepage`` are left out. A file's pages are
    the page cache's: they sit where the first process to read them put them, whatever the memory
    policy of the processes that map them later.
    """
    by_file: dict[str, dict[int, int]] = {}
    for line in numa_maps_text.splitlines():
        found = _FILE.search(line)
        if found is None or " N" not in line:
            continue
        path = found.group(1).replace("\\040", " ")
        if path.startswith("/anon_hugepage") or _SHARED_LIBRARY.search(path.removesuffix(" (deleted)")):
            continue
        nodes = by_file.setdefault(path, {})
        for node, size in _bytes_by_node(line, page_size):
            nodes[node] = nodes.get(node, 0) + size
    return {path: nodes for path, nodes in by_file.items() if sum(nodes.values()) >= min_bytes}


def _live_field(stat_text: str, field: int) -> Optional[int]:
    """Field ``field`` (1-based) of a ``/proc/PID/task/TID/stat`` text as an int; None for an exited
    (zombie/dead) thread or an unreadable line."""
    _, sep, rest = stat_text.rpartition(")")   # comm may hold spaces and parentheses
    fields = rest.split()
    if not sep or len(fields) < field - 2 or fields[0] in ("Z", "X", "x"):
        return None
    try:
        return int(fields[field - 3])
    except ValueError:
        return None


def last_cpu(stat_text: str) -> Optional[int]:
    """The CPU a thread last ran on (``processor``) from its ``/proc/PID/task/TID/stat``;
    None for an exited (zombie/dead) thread or an unreadable line."""
    return _live_field(stat_text, _PROCESSOR_FIELD)


def exiting(stat_text: str) -> bool:
    """True when a ``/proc/PID/task/TID/stat`` text is of a thread that has begun to exit (``PF_EXITING``),
    is a zombie, or cannot be read. Once every thread of a process has, its maps may be read while they
    are torn down (kernels that read ``maps`` under per-VMA locks show a half-removed address space)."""
    flags = _live_field(stat_text, _FLAGS_FIELD)
    return flags is None or bool(flags & _PF_EXITING)


def preload_kinds(ld_preload: str) -> dict[str, str]:
    """``{path: kind}`` of the allocator/OpenMP libraries named in an ``LD_PRELOAD`` value."""
    out: dict[str, str] = {}
    for entry in re.split(r"[ :]+", ld_preload):
        kind = library_kind(entry) if entry else None
        if kind is not None:
            out[entry] = kind
    return out


def resolved(preloaded: dict[str, str]) -> dict[str, str]:
    """``preloaded`` with each path as /proc/PID/maps shows it: symbolic links resolved (a venv reached
    through a link, ``/lib`` -> ``usr/lib``); bare file names as they are."""
    return {os.path.realpath(path) if "/" in path else path: kind for path, kind in preloaded.items()}


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
    files_by_node: Optional[tuple[tuple[str, tuple[tuple[int, int], ...]], ...]] = None   # (path, bytes by node)


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
    return read_sample(pid, memory, {})


def read_sample(pid: int, memory: bool, preload_cache: dict[int, dict[str, str]]) -> Sample:
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
                preloaded = preload_cache[pid] = resolved(preload_kinds(env.get("LD_PRELOAD", "")))
            active, shadowed = split_openmp(libraries, preloaded)
        by_node = files = None
        if memory:
            numa_maps = _read(f"/proc/{pid}/numa_maps")
            by_node = tuple(sorted(anonymous_memory_by_node(numa_maps, page_size).items()))
            files = tuple((path, tuple(sorted(nodes.items())))
                          for path, nodes in sorted(mapped_file_memory_by_node(numa_maps, page_size).items()))
        threads, live = [], False          # read after the maps: see below
        for tid in _list_ints(f"/proc/{pid}/task"):
            try:
                stat = _read(f"/proc/{pid}/task/{tid}/stat")
            except OSError:
                continue                   # the thread ended
            cpu = last_cpu(stat)
            if cpu is not None:
                threads.append((tid, cpu))
                live = live or not exiting(stat)
    except (OSError, psutil.NoSuchProcess):
        return None
    if not live:   # every thread is exiting: the address space, torn down once they all have, may have been read half gone
        return None
    return ProcessSample(pid=pid, libraries=tuple(libraries), openmp_active=tuple(active),
                         openmp_shadowed=tuple(shadowed), threads=tuple(threads), memory_by_node=by_node,
                         files_by_node=files)


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
