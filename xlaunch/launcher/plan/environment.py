"""The environment of each instance: OpenMP, allocator and xlaunch variables (pure functions).

Two decisions, both made from Options and the Machine, never from the live process:

* :func:`choose_runtime` — which OpenMP runtime and which allocator (and the library files);
* :func:`instance_environment` — the variables for one instance, added to the user's
  environment without ever replacing a value the user set (those are reported as *kept*).
"""
from __future__ import annotations

import os
import re

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Mapping, Optional, Sequence

from xlaunch._records import factory, record
from xlaunch.cpulist import format_cpulist
from xlaunch.launcher.errors import PlanError
from xlaunch.machine.model import Library, Machine

GNU = "gnu"
INTEL = "intel"
LLVM = "llvm"           # only when the user's LD_PRELOAD has LLVM's libomp (xlaunch never adds it)

# jemalloc: big allocations straight from their own extents (oversize_threshold:1), transparent
# huge pages for metadata, and freed pages never purged (decay -1), so a steady-state loop never
# page-faults. Measured on examples/infer.py (2 CPUs, 3 interleaved runs): ~290 img/s with decay
# -1 vs ~200 with 10 s or 60 s decay, and a background purging thread only costs CPU. The price:
# the process keeps its peak memory (as IPEX's launcher did). --benchmark changes nothing here.
JEMALLOC_CONF = "oversize_threshold:1,background_thread:false,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_CONF_BENCHMARK = JEMALLOC_CONF
# glibc without a preloaded allocator: blocks up to 32 MiB (glibc's maximum on 64-bit) come from
# the heap instead of fresh mmap()s, and the heap top is trimmed only past 1 GiB (4 GiB with
# --benchmark) -- this stops the mmap/munmap + page-fault churn of tensor-sized allocations.
GLIBC_TUNABLES_VALUE = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
GLIBC_TUNABLES_BENCHMARK = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
# gperftools prints a line for every allocation above 1 GiB by default; that is noise here.
TCMALLOC_REPORT_THRESHOLD = str(1 << 40)

_MALLOC_LIBRARY = re.compile(r"lib(jemalloc|tcmalloc|mimalloc|hoard|tbbmalloc)", re.IGNORECASE)
# An OpenMP runtime a user preloads on purpose (libgomp is also preloaded for other reasons, e.g. its
# static TLS, and is left under Intel's as before): it takes every OpenMP entry point, as xlaunch's would.
_CHOSEN_OPENMP = re.compile(r"^lib(iomp5|omp)(?:[-_.][^/]*)?\.so(?:\.[\d.]+)?$")


@record
class Runtime:
    """The OpenMP runtime and allocator every instance gets."""

    openmp: str                               # gnu (torch's own libgomp) | intel (libiomp5) | llvm (the user's libomp)
    openmp_library: Optional[str]             # the libiomp5 xlaunch preloads, when it does
    allocator: str                            # jemalloc | tcmalloc | tcmalloc_minimal | glibc | default | user
    allocator_library: Optional[str]          # the file preloaded, when any
    benchmark: bool = False
    warnings: tuple[str, ...] = ()


@record
class InstanceEnvironment:
    """The complete environment of one instance and how it differs from the user's."""

    env: dict[str, str]
    added: dict[str, str] = factory(dict)   # what xlaunch set or extended
    kept: dict[str, str] = factory(dict)    # user values xlaunch would have changed


def preload_entries(value: str) -> list[str]:
    """Split ``LD_PRELOAD`` the way the dynamic loader does (spaces and colons)."""
    return [entry for entry in re.split(r"[ :]+", value) if entry]


def preload_names(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """(``LD_PRELOAD`` entries for ``paths``, the folders ``LD_LIBRARY_PATH`` needs for them).

    The loader splits ``LD_PRELOAD`` at spaces and colons, with no escape: a library in a folder with a
    space (a venv under "My Projects") is named by its file name and found through its folder, first in
    ``LD_LIBRARY_PATH`` (split at colons only). :func:`choose_runtime` never picks a path with a colon.
    """
    entries: list[str] = []
    folders: list[str] = []
    for path in paths:
        if " " in path:
            folder, name = os.path.split(path)
            entries.append(name)
            if folder not in folders:
                folders.append(folder)
        else:
            entries.append(path)
    return entries, folders


def library_path(folders: Sequence[str], user_value: str = "") -> str:
    """``LD_LIBRARY_PATH`` with ``folders`` first, then the entries of ``user_value`` not among them."""
    return ":".join([*folders, *(f for f in user_value.split(":") if f and f not in folders)])


def _preloadable(machine: Machine, kind: str, warnings: list[str]) -> Optional[Library]:
    """The first library of ``kind`` the loader can be told to preload (no colon in its path)."""
    for lib in machine.libraries:
        if lib.kind != kind:
            continue
        if ":" in lib.path:
            warnings.append(f"{lib.path!r} cannot be preloaded (LD_PRELOAD and LD_LIBRARY_PATH split at "
                            "colons); link it from a folder without one")
            continue
        return lib
    return None


def choose_runtime(
    machine: Machine,
    *,
    memory_allocator: str = "auto",
    omp_runtime: str = "auto",
    benchmark: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Runtime:
    """Pick the OpenMP runtime and the allocator from the libraries the machine model found.

    ``auto`` allocator: jemalloc, else tcmalloc, else tcmalloc_minimal, else tuned glibc malloc.
    ``auto`` OpenMP: Intel OpenMP when libiomp5 is found (IPEX's launcher default), else GNU.
    An allocator already in the user's ``LD_PRELOAD`` is respected. Raises :class:`PlanError`
    when a library asked for by name is not installed.
    """
    environ = environ or {}
    warnings: list[str] = []
    user_preload = preload_entries(environ.get("LD_PRELOAD", ""))
    user_allocator = next((e for e in user_preload if _MALLOC_LIBRARY.search(os.path.basename(e))), None)

    allocator, allocator_library = "default", None
    if memory_allocator == "jemalloc":
        lib = _preloadable(machine, "jemalloc", warnings)
        if lib is None:
            raise PlanError("--memory-allocator", "jemalloc not found (Debian: apt install libjemalloc2)")
        allocator, allocator_library = "jemalloc", lib.path
    elif memory_allocator == "tcmalloc":
        lib = _preloadable(machine, "tcmalloc", warnings) or _preloadable(machine, "tcmalloc_minimal", warnings)
        if lib is None:
            raise PlanError(
                "--memory-allocator", "tcmalloc not found (Debian: apt install libtcmalloc-minimal4)"
            )
        allocator, allocator_library = lib.kind, lib.path
    elif memory_allocator == "auto":
        for kind in ("jemalloc", "tcmalloc", "tcmalloc_minimal"):
            lib = _preloadable(machine, kind, warnings)
            if lib is not None:
                allocator, allocator_library = kind, lib.path
                break
        else:
            allocator = "glibc"
            warnings.append(
                "no jemalloc or tcmalloc found: using glibc malloc with tuned GLIBC_TUNABLES "
                "(install libjemalloc2 for the best throughput)"
            )
    if allocator_library is not None and user_allocator is not None:
        warnings.append(f"kept the allocator in your LD_PRELOAD ({user_allocator}); not adding {allocator}")
        allocator, allocator_library = "user", None

    openmp, openmp_library = GNU, None
    iomp = _preloadable(machine, "iomp", warnings) if omp_runtime in ("intel", "auto") else None
    if omp_runtime == "intel":
        if iomp is None:
            raise PlanError("--omp-runtime", "Intel OpenMP (libiomp5.so) not found (pip install intel-openmp)")
        openmp, openmp_library = INTEL, iomp.path
    elif omp_runtime == "auto" and iomp is not None:
        openmp, openmp_library = INTEL, iomp.path
    for entry in user_preload:
        chosen = _CHOSEN_OPENMP.match(os.path.basename(entry))
        if chosen:
            kind = INTEL if chosen.group(1) == "iomp5" else LLVM
            openmp, openmp_library = _users_openmp(entry, kind, omp_runtime, openmp_library, warnings)
            break
    return Runtime(
        openmp=openmp,
        openmp_library=openmp_library,
        allocator=allocator,
        allocator_library=allocator_library,
        benchmark=benchmark,
        warnings=tuple(warnings),
    )


def _users_openmp(path: str, kind: str, omp_runtime: str, ours: Optional[str],
                  warnings: list[str]) -> tuple[str, None]:
    """The runtime of the user's ``LD_PRELOAD`` (``kind``, at ``path``) is the one that runs: it is kept, and
    xlaunch adds no second one (two runtimes in a process keep two thread pools)."""
    if omp_runtime == "intel" and kind != INTEL:
        raise PlanError("--omp-runtime", f"intel, but your LD_PRELOAD already has LLVM OpenMP ({path}): remove "
                                         "it from LD_PRELOAD, or leave --omp-runtime at auto to keep it")
    if ours is not None and kind != INTEL:
        warnings.append(f"kept the OpenMP runtime in your LD_PRELOAD ({path}); not adding Intel OpenMP")
    elif omp_runtime == "default":
        warnings.append(f"--omp-runtime default: the OpenMP runtime in your LD_PRELOAD ({path}) runs, "
                        "not torch's own libgomp")
    return kind, None


def team_places(cpus: Sequence[int]) -> str:
    """An Intel OpenMP proclist that binds the team's worker threads but not its master thread.

    Entry 0 -- the master, i.e. the process's main thread -- is the whole instance; worker ``i``
    gets ``cpus[i]``: ``{0,1,2,3},1,2,3``. Binding the master to ``cpus[0]`` as well narrows the
    main thread at the first parallel region, and every thread the program starts afterwards
    (data loading, a server, a Task) inherits that one CPU.

    Measured (docs/runtime.md, examples/infer.py in a 2-CPU instance, interleaved medians on a
    shared machine): with libiomp5 binding only the workers was 1.25x and 1.47x the throughput
    of binding all; with libgomp it was 1.07x in one series and 0.69x in another -- its workers
    spin while waiting, and a floating master shared a worker's CPU in about half of the
    samples -- so GNU OpenMP keeps one place per CPU, master included.
    """
    whole = "{" + ",".join(str(c) for c in cpus) + "}"
    return ",".join([whole, *(str(c) for c in cpus[1:])])


def runtime_variables(runtime: Runtime, cpus: Sequence[int], index: int, ninstances: int) -> dict[str, str]:
    """The variables xlaunch wants for one instance (before the user's environment is consulted).

    ``LD_PRELOAD`` (and ``LD_LIBRARY_PATH``, for a library in a folder with a space: :func:`preload_names`)
    here hold only xlaunch's entries; :func:`instance_environment` prepends them to the user's.
    """
    count = str(len(cpus))
    wanted: dict[str, str] = {"OMP_NUM_THREADS": count, "MKL_NUM_THREADS": count}
    preload: list[str] = []
    if runtime.allocator_library:
        preload.append(runtime.allocator_library)
    if runtime.openmp in (INTEL, LLVM):      # LLVM's libomp reads Intel's variables (one code base)
        if runtime.openmp_library:
            preload.append(runtime.openmp_library)
        wanted["KMP_AFFINITY"] = f"granularity=fine,proclist=[{team_places(cpus)}],explicit"
        wanted["KMP_BLOCKTIME"] = "1"
    else:
        # One place per CPU: libgomp binds the main thread to cpus[0] when it loads (see team_places).
        wanted["OMP_PROC_BIND"] = "close"
        wanted["OMP_PLACES"] = ",".join("{%d}" % c for c in cpus)
    if runtime.allocator == "jemalloc":
        wanted["MALLOC_CONF"] = JEMALLOC_CONF_BENCHMARK if runtime.benchmark else JEMALLOC_CONF
    elif runtime.allocator in ("tcmalloc", "tcmalloc_minimal"):
        wanted["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = TCMALLOC_REPORT_THRESHOLD
        if runtime.benchmark:
            wanted["TCMALLOC_RELEASE_RATE"] = "0"
    elif runtime.allocator == "glibc":
        wanted["GLIBC_TUNABLES"] = GLIBC_TUNABLES_BENCHMARK if runtime.benchmark else GLIBC_TUNABLES_VALUE
    if preload:
        entries, folders = preload_names(preload)
        wanted["LD_PRELOAD"] = ":".join(entries)
        if folders:
            wanted["LD_LIBRARY_PATH"] = ":".join(folders)
    return wanted


def instance_environment(
    base: Mapping[str, str],
    runtime: Runtime,
    *,
    cpus: Sequence[int],
    index: int,
    ninstances: int,
    extra: Mapping[str, str] | None = None,
    wanted: Mapping[str, str] | None = None,
) -> InstanceEnvironment:
    """``base`` plus xlaunch's variables for one instance; a variable the user already set keeps
    the user's value (reported in ``kept``) -- except ``LD_PRELOAD``, where xlaunch's libraries
    are prepended and the user's entries kept, and ``XLAUNCH_*``, which describe the instance.
    ``extra`` (e.g. from ``--auto-optimize``) is applied as given; ``wanted`` (e.g. from
    ``--kernel-report``) like xlaunch's own variables, never over the user's.
    """
    env = dict(base)
    added: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, value in {**runtime_variables(runtime, cpus, index, ninstances), **(wanted or {})}.items():
        if name == "LD_PRELOAD":
            user_entries = preload_entries(base.get("LD_PRELOAD", ""))
            ours = [p for p in value.split(":") if os.path.basename(p) not in {os.path.basename(u) for u in user_entries}]
            if not ours:
                continue
            env[name] = ":".join(ours + user_entries)
            added[name] = env[name]
        elif name == "LD_LIBRARY_PATH":      # the folders of preloaded file names, searched first
            env[name] = library_path(value.split(":"), base.get(name, ""))
            added[name] = env[name]
        elif name in base:
            if base[name] != value:
                kept[name] = base[name]
        else:
            env[name] = value
            added[name] = value
    ours_fixed = {
        "XLAUNCH_INSTANCE_INDEX": str(index),
        "XLAUNCH_NINSTANCES": str(ninstances),
        "XLAUNCH_CPUS": format_cpulist(cpus),
    }
    for name, value in {**ours_fixed, **(extra or {})}.items():
        env[name] = value
        added[name] = value
    return InstanceEnvironment(env=env, added=added, kept=kept)


# --kernel-report: oneDNN prints one line per primitive creation (never per execution) on stdout
ONEDNN_VERBOSE_VALUE = "profile_create"
_CREATION_FLAGS = frozenset({"profile_create", "profile", "all", "2"})
_EXECUTION_FLAGS = frozenset({"profile_exec", "profile", "all", "1", "2"})


def kernel_report_variables(environ: Mapping[str, str], notes: list[str]) -> dict[str, str]:
    """The variables ``--kernel-report`` wants (``ONEDNN_VERBOSE=profile_create``); appends to
    ``notes`` what a verbose setting of the user's, which is kept, means for the report
    (``DNNL_VERBOSE`` counts: oneDNN would let our ``ONEDNN_VERBOSE`` override it). Also
    ``XLAUNCH_KERNEL_MARKS=1``: ``optimize``/``quantize`` mark their builds in the stream, so the
    report counts the steady state apart (:mod:`xlaunch.kernels.build_mark`)."""
    from xlaunch.kernels.build_mark import MARKS_ENV

    marks = {MARKS_ENV: "1"}
    own = next(((name, environ[name]) for name in ("ONEDNN_VERBOSE", "DNNL_VERBOSE") if name in environ), None)
    if own is None:
        return {"ONEDNN_VERBOSE": ONEDNN_VERBOSE_VALUE, **marks}
    name, value = own
    flags = {flag.strip().lower() for flag in value.split(",")}
    if name == "DNNL_VERBOSE":
        notes.append(f"kept your DNNL_VERBOSE={value} (--kernel-report did not set ONEDNN_VERBOSE over it)")
    if not flags & _CREATION_FLAGS:
        notes.append(f"--kernel-report: your {name}={value} prints no primitive creation lines, which the kernel "
                     f"report is made of (unset it, or use {ONEDNN_VERBOSE_VALUE})")
    if flags & _EXECUTION_FLAGS:
        notes.append(f"--kernel-report: your {name}={value} prints a line per execution; they are taken out "
                     f"of the output too, but printing them slows the program down ({ONEDNN_VERBOSE_VALUE} "
                     "prints creations only)")
    if any(flag.startswith("filter=") for flag in flags):
        notes.append(f"--kernel-report: the filter in your {name} hides the primitives it does not match")
    return {"ONEDNN_VERBOSE": ONEDNN_VERBOSE_VALUE, **marks} if name == "ONEDNN_VERBOSE" else marks
