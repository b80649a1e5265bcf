"""``CPUPool``: a validated set of CPUs; ``pin``: pin the calling thread's OpenMP team to one.

    with CPUPool([0, 1]):          # or: with pin(pool):   or: @pin(pool)
        model(x)                   # torch's intra-op threads run on CPUs 0 and 1, one each

Entering gives the calling thread's OpenMP team ``len(pool)`` threads, team thread ``i`` pinned
to ``pool.cpus[i]`` (thread 0 is the caller). Leaving restores the previous thread count and
every touched thread's previous affinity. Pins nest.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import itertools
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from xlaunch._errors import as_index
from xlaunch.cpulist import MAX_ID, format_cpulist, parse_cpulist
from xlaunch.runtime_ext import openmp, topology


class CPUPool:
    """An ordered set of CPUs this process may use.

    ``CPUPool()`` is one CPU (the first SMT sibling) per allowed physical core;
    ``CPUPool(node_id=n)`` the same restricted to NUMA node ``n``; ``CPUPool([2, 3])`` or
    ``CPUPool("2-3")`` exactly those CPUs, in that order. Any CPU outside the allowed set is
    rejected with a :class:`ValueError` naming it. The machine is read on first construction,
    never at import.
    """

    __slots__ = ("_cpus", "_node_id", "_local")

    def __init__(self, core_ids: Union[Iterable[int], str, None] = None, node_id: Optional[int] = None) -> None:
        if core_ids is not None and node_id is not None:
            raise ValueError("give core_ids or node_id, not both")
        if node_id is not None:
            node_id = _node_index(node_id)
        if core_ids is not None:
            cpus = _validated_cpus(core_ids)
        elif node_id is not None:
            cpus = _node_cpus(node_id)
        else:
            cpus = tuple(core.cpus[0] for core in topology.allowed_cores())
            if not cpus:
                raise ValueError("this process is allowed no CPUs")
        self._cpus = cpus
        self._node_id = node_id
        self._local = threading.local()

    def __reduce__(self) -> tuple:
        """Pickled and copied as its CPUs (checked again where it is loaded) and node id."""
        return (_restored_pool, (self._cpus, self._node_id))

    @classmethod
    def from_node(cls, node_id: int) -> CPUPool:
        """One CPU per allowed physical core of NUMA node ``node_id``."""
        return cls(node_id=node_id)

    @property
    def cpus(self) -> tuple[int, ...]:
        """The CPUs, in pinning order (team thread ``i`` goes to ``cpus[i]``)."""
        return self._cpus

    core_ids = cpus

    @property
    def node_id(self) -> Optional[int]:
        return self._node_id

    def split(self, parts: int) -> list[CPUPool]:
        """``parts`` contiguous pools of nearly equal size (the first ones get one more CPU)."""
        if as_index(parts) is None:
            raise ValueError(f"parts must be an int from 1 to {len(self._cpus)}, got {parts!r}")
        parts = as_index(parts)
        if not 1 <= parts <= len(self._cpus):
            raise ValueError(f"cannot split a pool of {len(self._cpus)} CPUs into {parts} parts")
        return [CPUPool(chunk) for chunk in _chunks(self._cpus, parts)]

    def __len__(self) -> int:
        return len(self._cpus)

    def __iter__(self):
        return iter(self._cpus)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CPUPool) and other._cpus == self._cpus

    def __hash__(self) -> int:
        return hash(self._cpus)

    def __repr__(self) -> str:
        node = f", node_id={self._node_id}" if self._node_id is not None else ""
        return f"CPUPool(cpus='{format_cpulist(self._cpus)}', n={len(self._cpus)}{node})"

    def __enter__(self) -> CPUPool:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(pin_team(self._cpus))
        return self

    def __exit__(self, *exc: Any) -> None:
        unpin_team(self._local.stack.pop())


def _node_index(node_id: Any) -> int:
    index = as_index(node_id)
    if index is None or index < 0:
        raise ValueError(f"node_id must be a non-negative integer, got {node_id!r}")
    return index


def _restored_pool(cpus: tuple[int, ...], node_id: Optional[int]) -> CPUPool:
    """Unpickle a :class:`CPUPool`: the same CPUs, validated in this process, and node id."""
    pool = CPUPool(cpus)
    pool._node_id = node_id
    return pool


def _chunks(items: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def _validated_cpus(core_ids: Union[Iterable[int], str]) -> tuple[int, ...]:
    if isinstance(core_ids, str):
        try:
            cpus = parse_cpulist(core_ids)
        except ValueError as error:
            raise ValueError(f"core_ids: {error}") from None
    else:
        try:
            items = iter(core_ids)
        except TypeError:
            raise TypeError(
                f"core_ids must be a list of CPU ids or a string like '0-3', got {type(core_ids).__name__}"
            ) from None
        cpus = tuple(itertools.islice(items, MAX_ID + 2))
        if len(cpus) > MAX_ID + 1:
            raise ValueError(f"core_ids names more CPUs than any machine has (over {MAX_ID + 1})")
        wrong = [c for c in cpus if as_index(c) is None or as_index(c) < 0]
        if wrong:
            raise ValueError(f"CPU ids must be non-negative integers, got {wrong!r}")
        cpus = tuple(as_index(c) for c in cpus)
    if not cpus:
        raise ValueError("a CPUPool needs at least one CPU")
    duplicates = sorted(c for c, n in collections.Counter(cpus).items() if n > 1)
    if duplicates:
        raise ValueError(f"CPU ids repeated in the pool: {format_cpulist(duplicates)}")
    allowed = topology.allowed_cpus()
    outside = [c for c in cpus if c not in allowed]
    if outside:
        which = f"CPU {outside[0]} is" if len(outside) == 1 else f"CPUs {format_cpulist(outside)} are"
        raise ValueError(f"{which} not allowed for this process (allowed: {format_cpulist(allowed) or 'none'})")
    return cpus


def _node_cpus(node_id: int) -> tuple[int, ...]:
    cpus = tuple(core.cpus[0] for core in topology.allowed_cores() if core.node == node_id)
    if not cpus:
        nodes = ",".join(map(str, topology.node_ids())) or "none"
        raise ValueError(f"NUMA node {node_id} has no CPU this process may use (nodes with allowed CPUs: {nodes})")
    return cpus


def get_core_list_of_node_id(node_id: int) -> list[int]:
    """IPEX's helper: the CPUs of ``CPUPool(node_id=node_id)`` -- one (the first SMT sibling) per
    physical core of that NUMA node that this process may use."""
    return list(_node_cpus(_node_index(node_id)))


# ---------------------------------------------------------------------------------------------
# Pinning: effects on the calling thread's OpenMP team.


@dataclass(frozen=True)
class _PinRecord:
    thread_num: int               # 0 is the thread that pinned its team
    tid: int
    previous: frozenset[int]


@dataclass(frozen=True)
class TeamPin:
    """What :func:`pin_team` changed, so that :func:`unpin_team` can put it back."""

    cpus: tuple[int, ...]
    previous_threads: int
    records: tuple[_PinRecord, ...]
    pid: int = field(default_factory=os.getpid)
    previous_mkl: Optional[int] = None   # the thread's MKL setting before (0: MKL's global one)


def _torch_module() -> Any:
    """torch when it is already imported (never imports it)."""
    return sys.modules.get("torch")


def get_thread_count(runtime: openmp.OpenMPRuntime) -> int:
    torch = _torch_module()
    return int(torch.get_num_threads()) if torch is not None else runtime.get_max_threads()


def set_thread_count(runtime: openmp.OpenMPRuntime, n: int) -> None:
    """Calling thread's team size: through torch when loaded (OpenMP + MKL + ATen), else OpenMP."""
    torch = _torch_module()
    if torch is not None:
        torch.set_num_threads(n)
    else:
        runtime.set_num_threads(n)


@functools.lru_cache(maxsize=1)
def _mkl_set_num_threads_local() -> Optional[Any]:
    """MKL's per-thread setter from the loaded torch (or MKL), else None: its C entry
    ``MKL_Set_Num_Threads_Local`` (the lower-case name is the Fortran one, taking a pointer). Looked up
    once (it is only asked for once torch is loaded)."""
    for mapped in openmp.mapped_libraries(("libtorch_cpu", "libmkl_rt")):
        try:
            function = ctypes.CDLL(mapped, mode=getattr(os, "RTLD_NOLOAD", 4)).MKL_Set_Num_Threads_Local
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
        return function
    return None


def _size_own_team(runtime: openmp.OpenMPRuntime, n: int, previous_mkl: Optional[int] = None) -> Optional[int]:
    """The calling thread's team size (OpenMP, and MKL's when torch is loaded), nothing else.

    Not ``torch.set_num_threads``: it also sets torch's process-wide default, which every thread
    that has not yet run a parallel torch op starts from (a pool in one thread made threads
    started meanwhile, and the main thread after a MultiStreamModule, run on one thread). Returns
    MKL's previous per-thread setting (to give back as ``previous_mkl``).
    """
    if _torch_module() is not None:
        _torch_module().get_num_threads()  # torch sizes a thread at its first use: let that happen now
    runtime.set_num_threads(n)
    mkl = _mkl_set_num_threads_local() if _torch_module() is not None else None
    if mkl is None:
        return None
    return int(mkl(previous_mkl if previous_mkl is not None else n))


def pin_team(cpus: tuple[int, ...]) -> TeamPin:
    """Give the calling thread a ``len(cpus)`` OpenMP team, thread ``i`` pinned to ``cpus[i]``."""
    topology.allowed_cores()  # read (and cache) the process's CPUs before any thread is pinned
    runtime = openmp.loaded_runtime()
    if not runtime.can_run_teams:
        raise openmp.OpenMPNotFoundError(f"{runtime.path} does not export GOMP_parallel: pinning unsupported")
    size = len(cpus)
    previous_threads = get_thread_count(runtime)
    previous_mkl = _size_own_team(runtime, size)
    records: list[Optional[_PinRecord]] = [None] * size

    def pin_self(thread_num: int, team_size: int) -> None:
        if thread_num < size:
            previous = frozenset(os.sched_getaffinity(0))
            try:
                os.sched_setaffinity(0, {cpus[thread_num]})
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                raise OSError(errno.EINVAL, f"cannot pin to CPU {cpus[thread_num]}: this process may not use it now "
                                            "(its cpuset changed since the pool was made?)") from None
            records[thread_num] = _PinRecord(thread_num, threading.get_native_id(), previous)

    try:
        runtime.run_on_team(size, pin_self)
    except BaseException:
        unpin_team(TeamPin(cpus, previous_threads, tuple(r for r in records if r is not None), previous_mkl=previous_mkl))
        raise
    done = tuple(r for r in records if r is not None)
    if size > 1:
        _note_team_pin(runtime, +1)
    if len(done) < size:
        warnings.warn(
            f"the OpenMP runtime gave a team of {len(done)} threads, not {size}: "
            f"only CPUs {format_cpulist(cpus[: len(done)])} have a thread (OMP_DYNAMIC or a thread limit?)",
            RuntimeWarning,
            stacklevel=3,
        )
    return TeamPin(cpus, previous_threads, done, previous_mkl=previous_mkl)


_team_pins: collections.Counter = collections.Counter()   # thread id -> its live pins of 2+ CPUs
_team_pins_lock = threading.Lock()
_shared_pool_warned = False


def _note_team_pin(runtime: openmp.OpenMPRuntime, delta: int) -> None:
    """Count the calling thread's live pins of 2+ CPUs; say once when two threads hold one at the same
    time under a runtime that moves team threads between threads' teams (their placement can be wrong)."""
    global _shared_pool_warned
    with _team_pins_lock:
        _team_pins[threading.get_ident()] += delta
        if _team_pins[threading.get_ident()] <= 0:
            del _team_pins[threading.get_ident()]
        warn = delta > 0 and len(_team_pins) > 1 and not _shared_pool_warned and runtime.moves_threads_between_teams
        _shared_pool_warned = _shared_pool_warned or warn
    if warn:
        warnings.warn(
            f"pools of 2 or more CPUs in several threads at once under LLVM libomp: a team that shrinks gives its "
            f"threads to other threads' teams, so a pool may run on threads pinned for another one; start the "
            f"program with {openmp.HOT_TEAMS_MODE_ENV}=1 in its environment to keep them",
            RuntimeWarning,
            stacklevel=4,
        )


def unpin_team(pinned: TeamPin) -> None:
    """Undo :func:`pin_team`: previous affinity of every pinned thread, previous thread count.

    In a child forked inside the pin, only the calling thread exists (as a copy of team thread
    0); the other thread ids still name the parent's threads, which are left alone.
    """
    forked = pinned.pid != os.getpid()
    if len(pinned.cpus) > 1 and not forked:
        _note_team_pin(openmp.loaded_runtime(), -1)
    for record in reversed(pinned.records):
        if forked and record.thread_num != 0:
            continue
        try:
            os.sched_setaffinity(0 if forked else record.tid, record.previous)
        except (ProcessLookupError, OSError):
            pass  # the thread is gone, nothing to restore
    _size_own_team(openmp.loaded_runtime(), pinned.previous_threads, pinned.previous_mkl)


class pin(contextlib.ContextDecorator):  # noqa: N801 - reads as a verb, like contextlib's helpers
    """``with pin(pool):`` or ``@pin(pool)``: pin the calling thread's OpenMP team to ``pool``.

    ``pool`` is a :class:`CPUPool` or anything :class:`CPUPool` accepts as ``core_ids``.
    """

    def __init__(self, pool: Union[CPUPool, Iterable[int], str]) -> None:
        self.pool = pool if isinstance(pool, CPUPool) else CPUPool(pool)
        self._local = threading.local()

    def __enter__(self) -> CPUPool:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(pin_team(self.pool.cpus))
        return self.pool

    def __exit__(self, *exc: Any) -> None:
        unpin_team(self._local.stack.pop())

    def __reduce__(self) -> tuple:
        return (pin, (self.pool,))

    def __repr__(self) -> str:
        return f"pin({self.pool!r})"
