"""The OpenMP runtime loaded in this process, found in ``/proc/self/maps`` and bound with ctypes.

Works with GNU libgomp (stock torch wheels), Intel libiomp5 (e.g. ``LD_PRELOAD`` from the
``intel-openmp`` package) and LLVM libomp. All three export the GNU entry point
``GOMP_parallel``; :func:`run_on_team` uses it to run a Python callback on every thread of the
calling thread's OpenMP team, which is the team torch's ``at::parallel_for`` reuses.

Nothing here loads a runtime: when none is mapped, :class:`OpenMPNotFoundError` says so.
"""
from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

GOMP = "gomp"
IOMP = "iomp"
LLVM_OMP = "omp"

# basename prefix -> kind; checked in this order ("libgomp" must not be read as "libomp").
_KINDS = (("libgomp", GOMP), ("libiomp5", IOMP), ("libiomp", IOMP), ("libomp", LLVM_OMP))
_RTLD_NOLOAD = getattr(os, "RTLD_NOLOAD", 4)
HOT_TEAMS_MODE_ENV = "KMP_HOT_TEAMS_MODE"


class OpenMPNotFoundError(RuntimeError):
    """No OpenMP runtime is loaded in this process."""


@dataclass(frozen=True)
class MappedRuntime:
    """An OpenMP shared library mapped into this process (a line of ``/proc/self/maps``)."""

    kind: str   # gomp | iomp | omp
    path: str   # the mapped file, as the kernel names it


def runtime_kind(path: str) -> Optional[str]:
    """``gomp``/``iomp``/``omp`` when ``path`` names an OpenMP runtime library, else None."""
    name = os.path.basename(path)
    if ".so" not in name:
        return None
    for prefix, kind in _KINDS:
        if name.startswith(prefix + ".") or name.startswith(prefix + "-"):
            return kind
    return None


def mapped_paths(text: str) -> tuple[str, ...]:
    """The files named in ``/proc/<pid>/maps`` text, in first-mapped order, each once (`` (deleted)`` dropped)."""
    found: dict[str, None] = {}
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6:
            path = fields[5].strip()
            found.setdefault(path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path, None)
    return tuple(found)


def parse_maps(text: str) -> tuple[MappedRuntime, ...]:
    """OpenMP runtimes named in ``/proc/<pid>/maps`` text, in first-mapped order, no duplicates."""
    return tuple(MappedRuntime(kind, path) for path in mapped_paths(text)
                 if (kind := runtime_kind(path)) is not None)


def mapped_runtimes() -> tuple[MappedRuntime, ...]:
    """OpenMP runtimes mapped into this process right now."""
    with open("/proc/self/maps") as maps:
        return parse_maps(maps.read())


def mapped_libraries(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """Paths of the shared libraries mapped into this process whose file name starts with one of
    ``prefixes`` (e.g. ``libtorch_cpu``), in first-mapped order."""
    with open("/proc/self/maps") as maps:
        return tuple(path for path in mapped_paths(maps.read())
                     if os.path.basename(path).startswith(prefixes) and ".so" in path)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _globally_resolved_path(symbol: str) -> Optional[str]:
    """The file that defines ``symbol`` in the global lookup scope (what the loader binds first)."""
    try:
        process = ctypes.CDLL(None)
        function = getattr(process, symbol)
        dladdr = process.dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def choose_active(mapped: tuple[MappedRuntime, ...], global_path: Optional[str]) -> Optional[MappedRuntime]:
    """The runtime that symbol lookups bind to: the globally resolved one, else the first mapped."""
    if not mapped:
        return None
    if global_path is not None:
        real = os.path.realpath(global_path)
        for runtime in mapped:
            if runtime.path == global_path or os.path.realpath(runtime.path) == real:
                return runtime
    return mapped[0]


_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class OpenMPRuntime:
    """ctypes bindings to one loaded OpenMP runtime (opened with ``RTLD_NOLOAD``)."""

    def __init__(self, mapped: MappedRuntime) -> None:
        self.kind = mapped.kind
        self.path = mapped.path
        try:
            self._lib = ctypes.CDLL(mapped.path, mode=_RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError as error:
            raise OpenMPNotFoundError(f"cannot open the loaded OpenMP runtime {mapped.path}: {error}") from error
        lib = self._lib
        for name in ("omp_get_max_threads", "omp_get_thread_num", "omp_get_num_threads", "omp_get_dynamic"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = []
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        lib.omp_set_num_threads.restype = None
        try:
            self._gomp_parallel = lib.GOMP_parallel
        except AttributeError:
            self._gomp_parallel = None
        else:
            self._gomp_parallel.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            self._gomp_parallel.restype = None

    def __repr__(self) -> str:
        return f"OpenMPRuntime(kind={self.kind!r}, path={self.path!r})"

    @property
    def can_run_teams(self) -> bool:
        """Whether this runtime exports ``GOMP_parallel`` (needed to pin team threads)."""
        return self._gomp_parallel is not None

    def get_max_threads(self) -> int:
        """``omp_get_max_threads()`` of the calling thread (its next team size)."""
        return int(self._lib.omp_get_max_threads())

    def set_num_threads(self, n: int) -> None:
        """``omp_set_num_threads(n)`` for the calling thread."""
        if n < 1:
            raise ValueError(f"number of threads must be >= 1, got {n}")
        self._lib.omp_set_num_threads(int(n))

    def get_dynamic(self) -> bool:
        return bool(self._lib.omp_get_dynamic())

    @property
    def moves_threads_between_teams(self) -> bool:
        """LLVM libomp without ``KMP_HOT_TEAMS_MODE=1`` in the environment: a team that shrinks (a small
        torch op, a nested smaller pool) hands its extra threads to one pool every thread's team draws
        from, so a team of another Python thread may take a thread pinned for this one's pool.

        The mode is read before the runtime's first parallel region only (``kmp_set_defaults`` later is
        ignored, with a warning on stderr), so it cannot be set from here. libgomp keeps a pool per
        thread; Intel's libiomp5 kept its threads in every run of the test (not known to be guaranteed).
        """
        return self.kind == LLVM_OMP and os.environ.get(HOT_TEAMS_MODE_ENV, "").strip() != "1"

    def place_cpus(self) -> tuple[int, ...]:
        """Every CPU named by the runtime's places (``OMP_PLACES``, ``KMP_AFFINITY``), sorted.

        Empty when the runtime binds nothing or predates OpenMP 4.5 (no ``omp_get_place_*``).
        """
        lib = self._lib
        try:
            num_places, num_procs, proc_ids = lib.omp_get_num_places, lib.omp_get_place_num_procs, lib.omp_get_place_proc_ids
        except AttributeError:
            return ()
        num_places.restype, num_places.argtypes = ctypes.c_int, []
        num_procs.restype, num_procs.argtypes = ctypes.c_int, [ctypes.c_int]
        proc_ids.restype, proc_ids.argtypes = None, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        cpus: set[int] = set()
        for place in range(max(0, int(num_places()))):
            count = int(num_procs(place))
            if count > 0:
                ids = (ctypes.c_int * count)()
                proc_ids(place, ids)
                cpus.update(int(i) for i in ids if i >= 0)
        return tuple(sorted(cpus))

    def run_on_team(self, num_threads: int, work: Callable[[int, int], None]) -> None:
        """Run ``work(thread_num, team_size)`` on each thread of a ``num_threads`` team of the caller.

        Thread 0 is the calling thread. Exceptions raised by ``work`` on any thread are re-raised
        here (the first one) after the region ends.
        """
        if self._gomp_parallel is None:
            raise OpenMPNotFoundError(f"{self.path} does not export GOMP_parallel; cannot reach its team threads")
        errors: list[BaseException] = []
        lock = threading.Lock()
        lib = self._lib

        def body(_data: Optional[int]) -> None:
            try:
                work(int(lib.omp_get_thread_num()), int(lib.omp_get_num_threads()))
            except BaseException as error:  # noqa: BLE001 - carried to the caller below
                with lock:
                    errors.append(error)

        callback = _CALLBACK(body)
        self._gomp_parallel(callback, None, int(num_threads), 0)
        if errors:
            raise errors[0]


_lock = threading.Lock()
_cached: Optional[OpenMPRuntime] = None


def find_runtime() -> Optional[OpenMPRuntime]:
    """The OpenMP runtime this process uses, or None when none is loaded (cached once found)."""
    global _cached
    with _lock:
        if _cached is None:
            active = choose_active(mapped_runtimes(), _globally_resolved_path("omp_get_max_threads"))
            if active is not None:
                _cached = OpenMPRuntime(active)
        return _cached


def loaded_runtime() -> OpenMPRuntime:
    """Like :func:`find_runtime` but raises one clear :class:`OpenMPNotFoundError` when there is none."""
    runtime = find_runtime()
    if runtime is None:
        from xlaunch._torch import INSTALL, torch_installed

        raise OpenMPNotFoundError(
            "no OpenMP runtime (libgomp, libiomp5 or libomp) is loaded in this process; "
            "import torch (or the library that uses OpenMP) before using xlaunch.runtime_ext"
            + ("" if torch_installed() else f" (torch is not installed: {INSTALL})")
        )
    return runtime


def pinning_supported() -> bool:
    """Whether team threads can be pinned here: a runtime is loaded, exports GOMP_parallel, Linux."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    runtime = find_runtime()
    return runtime is not None and runtime.can_run_teams


def is_runtime_ext_enabled() -> bool:
    """IPEX's name for :func:`pinning_supported` (IPEX asked for Intel OpenMP preloaded; any
    loaded runtime exporting ``GOMP_parallel`` will do here)."""
    return pinning_supported()
