"""Compiling the C++ operator libraries of :mod:`xlaunch.nn` and :mod:`xlaunch.llm` against the installed torch.

Each library is compiled once per ISA level (:mod:`xlaunch._isa_levels`): one shared library per level, registering
its operators in its own namespace (``torch.ops.xlaunch_nn_avx2``, ...; the sources write
``TORCH_LIBRARY_FRAGMENT(XLAUNCH_OPS, m)`` and ``-DXLAUNCH_OPS`` names it). A process loads only levels this CPU can
execute; :meth:`Library.ops` returns the chosen level's namespace. A build is stored under a key of its sources,
torch, flags and platform (not this CPU's flags): one made on any x86-64 machine serves every other. A wheel carries
them in ``<package>/prebuilt``. Sources every library compiles (``compiled_isa()``) live once, in ``xlaunch/_csrc``.
Each level parses the torch headers once (a precompiled header), then compiles its sources.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

from xlaunch import _isa_levels as isa
from xlaunch._errors import stacklevel_outside
from xlaunch._native_cache import (  # noqa: F401  (KEPT_BUILDS, STALE_SCRATCH_S: this module's surface too)
    KEPT_BUILDS, STALE_SCRATCH_S, build_folder, cache_root, incomplete, tidy_cache)
from xlaunch.userfiles import untrusted

FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-fPIC", "-DNDEBUG", "-w")
_TORCH_INCLUDE = re.compile(r"^#include <((?:ATen|c10|torch)/[^>]+)>", re.M)
SHARED_CSRC = Path(__file__).resolve().parent / "_csrc"
SHARED_SOURCES = ("isa_level.cpp",)     # compiled into every library (its compiled_isa() operator)


def compiler() -> Optional[str]:
    """The C++ compiler to use: ``$CXX`` when set (None when it is not found: another one never takes its place
    unsaid), else ``g++``/``c++`` on PATH; None when there is none."""
    chosen = os.environ.get("CXX", "").strip()
    for name in (chosen,) if chosen else ("g++", "c++"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def level_flags(namespace: str, level: str) -> tuple[str, ...]:
    """The flags of one level's library: the common ones, its ``-march``, its operator namespace."""
    return (*FLAGS, *isa.MARCH[level], f"-DXLAUNCH_OPS={namespace}_{level}")


def source_path(csrc: Path, name: str) -> Path:
    """Where a library's file ``name`` is: its own ``csrc``, or the shared folder for :data:`SHARED_SOURCES`."""
    return SHARED_CSRC / name if name in SHARED_SOURCES else csrc / name


def build_key(csrc: Path, files: Sequence[str], flags: Sequence[str] = FLAGS) -> str:
    """Hash of everything a library depends on: its files, torch (version, C++ ABI), flags, platform."""
    import torch

    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode())
        digest.update(source_path(csrc, name).read_bytes())
    for part in (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join(flags), sys.platform):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def torch_flags(csrc: Path, flags: Sequence[str] = FLAGS) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for an extension of the installed torch."""
    import torch
    from torch.utils import cpp_extension

    lib = Path(torch.__file__).resolve().parent / "lib"
    compile_flags = [*flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     *(f"-I{path}" for path in cpp_extension.include_paths()), f"-I{csrc}"]
    return compile_flags, [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _finish(process: subprocess.Popen, what: str, cxx: str, label: str) -> None:
    output, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"compiling the {label} kernels failed ({Path(cxx).name} exit {process.returncode} "
                           f"on {what}):\n{output[-4000:]}")


def compile_levels(csrc: Path, sources: Sequence[str], targets: dict, label: str,
                   echo: Callable[[str], None] = print, cxx: Optional[str] = None) -> None:
    """Compile ``sources`` once per level into ``targets`` (level -> (library path, flags)).

    Per level: a precompiled header of the torch headers the sources include, then the sources
    with it, then the link; as many compilers at once as there are CPUs, levels in the given
    order. Raises ``RuntimeError`` (with the compiler's output) when the compiler is missing or
    fails, or when a target's folder is a symlink. Each library is linked next to its final name
    and renamed into place; a failure or an interrupt leaves no compiler running.
    """
    cxx = cxx or compiler()
    if cxx is None:
        chosen = os.environ.get("CXX", "").strip()
        raise RuntimeError(f"CXX={chosen}: no such compiler (a path, or a command on PATH)" if chosen
                           else "no C++ compiler found (set CXX or install g++)")
    paths = [source_path(csrc, name) for name in sources]
    headers = sorted({name for path in paths for name in _TORCH_INCLUDE.findall(path.read_text())})
    for path, _ in targets.values():
        build_folder(path.parent)
    parallel = max(1, os.cpu_count() or 1)
    first = next(iter(targets.values()))[0]
    try:
        scratch_folder = tempfile.TemporaryDirectory(dir=first.parent, prefix=".build-")
    except OSError as exc:
        raise RuntimeError(f"cannot build into {first.parent}: {exc.strerror or exc}") from None
    with scratch_folder as scratch:
        jobs = []                                   # (level, what, command, output, needs)
        for level, (path, flags) in targets.items():
            folder = Path(scratch) / level
            folder.mkdir()
            compile_flags, link_flags = torch_flags(csrc, flags)
            pch = folder / "xlaunch_pch.h"
            pch.write_text("".join(f"#include <{name}>\n" for name in headers))
            jobs.append((level, "torch headers", [cxx, *compile_flags, "-x", "c++-header", str(pch), "-o",
                                                  f"{pch}.gch"], None, ()))
            objects = [folder / f"{Path(name).stem}.o" for name in sources]
            for name, source, obj in zip(sources, paths, objects):
                jobs.append((level, name, [cxx, *compile_flags, "-include", str(pch), "-c", str(source),
                                           "-o", str(obj)], obj, (f"{pch}.gch",)))
            partial = folder / path.name
            jobs.append((level, "linking", [cxx, "-shared", *flags, *map(str, objects), *link_flags, "-o",
                                            str(partial)], (partial, path), tuple(map(str, objects))))
        echo(f"{label}: compiling {len(sources)} sources at {len(targets)} ISA levels ({', '.join(targets)}) "
             f"with {Path(cxx).name}, {parallel} at a time ...")
        done: set = set()
        running: list = []
        try:
            while jobs or running:
                ready = next((job for job in jobs if all(need in done for need in job[4])), None)
                if ready is not None and len(running) < parallel:
                    jobs.remove(ready)
                    _starting[0] = True     # a SIGTERM inside Popen (after its fork) orphaned that compiler: held
                    process = subprocess.Popen(ready[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True, start_new_session=True)
                    _starting[0] = False
                    running.append((ready, process))
                    if _held:
                        raise SystemExit(128 + _held.pop())
                    continue
                (level, what, command, output, _), process = running[0]
                _finish(process, f"{what} ({level})", cxx, label)       # an interrupt here still kills it
                running.pop(0)
                done.add(command[-1])
                if isinstance(output, tuple):       # a linked library: into place, writable by us only
                    output[0].chmod(0o755)
                    if output[1].is_symlink():
                        output[1].unlink()
                    os.replace(*output)
                    echo(f"{label}: built {output[1]}")
        finally:                # each compiler with what it started (g++'s cc1plus, as): its own group
            _starting[0] = False
            for _, process in running:
                if process.poll() is None:
                    with contextlib.suppress(OSError):
                        os.killpg(process.pid, signal.SIGKILL)
                process.wait()


class Library:
    """One operator library: its levels, where each is built, building them, loading them once.

    ``sources``/``headers`` are called each time (``xlaunch.llm`` compiles every ``csrc/*.cpp``);
    ``levels`` are the ISA levels it is compiled at (a higher CPU level uses the best of them).
    Loading is lazy and thread-safe; a missing build warns once per process and the callers take
    their pure-torch paths. :meth:`prefer_native` is per thread (a ``threading.local``, which
    torch.compile guards on, where it cannot read a ``ContextVar``): a block never changes another
    thread's preference.
    """

    def __init__(self, label: str, stem: str, csrc: Path, namespace: str, disable_env: str, build_dir_env: str,
                 cache_subdir: str, sources: Callable[[], Sequence[str]], headers: Callable[[], Sequence[str]],
                 levels: Sequence[str] = isa.LEVELS[:-1]) -> None:
        self.label, self.stem, self.csrc, self.namespace = label, stem, csrc, namespace
        self.disable_env, self.build_dir_env, self.cache_subdir = disable_env, build_dir_env, cache_subdir
        self.sources, self.headers, self.levels = sources, headers, tuple(levels)
        self.lock = threading.Lock()
        self.loaded_levels: dict = {}           # level -> torch.ops namespace, or None: does not load
        self.warned = False
        self._local = threading.local()          # .preference: this thread's prefer_native
        self.chosen: Optional[tuple] = None     # (the cap it was chosen under, the level)
        self.refused: dict = {}                 # level -> why a library found for it is not loaded

    # -- where ---------------------------------------------------------------------------------
    def cache_dir(self) -> Path:
        explicit = os.environ.get(self.build_dir_env)
        return Path(explicit) if explicit else cache_root() / self.cache_subdir

    def prebuilt_dir(self) -> Path:
        """Where a wheel carries the prebuilt libraries."""
        return self.csrc.parent / "prebuilt"

    def build_key(self, level: Optional[str] = None) -> str:
        return build_key(self.csrc, (*self.sources(), *self.headers()),
                         level_flags(self.namespace, level or self.levels[0]))

    def file_name(self, level: str) -> str:
        return f"{self.stem}-{level}-{self.build_key(level)}.so"

    def level(self) -> Optional[str]:
        """The compiled level this process uses (``$XLAUNCH_CPU_ISA`` caps it); None off x86-64.

        Raises ``ValueError`` for a cap that is unknown or above this CPU.
        """
        cap = os.environ.get(isa.CAP_ENV, "")
        if self.chosen is None or self.chosen[0] != cap:      # every kernel call asks: decided once per cap
            machine = isa.chosen_level(cap=cap)
            self.chosen = (cap, isa.library_level(machine, self.levels) if machine else None)
        return self.chosen[1]

    def runnable_levels(self) -> tuple[str, ...]:
        """This library's levels that this CPU can execute, lowest first."""
        host = isa.host_levels()
        return tuple(level for level in self.levels if level in host)

    def find(self, level: str) -> Optional[Path]:
        """The built library of ``level``: the cache's, else the wheel's; None when neither exists or
        another user could have put it there (:func:`xlaunch.userfiles.untrusted`: never loaded)."""
        name = self.file_name(level)
        for folder in (self.cache_dir(), self.prebuilt_dir()):
            if (folder / name).is_file() and not (folder / name).is_symlink():
                reason = untrusted(str(folder / name))
                if reason is None:
                    return folder / name
                self.refused[level] = reason
        return None

    def library_path(self, level: Optional[str] = None) -> Path:
        """Where ``level``'s library (default: the chosen level) is, or would be built."""
        level = level or self.level() or self.levels[0]
        return self.find(level) or self.cache_dir() / self.file_name(level)

    def available(self, level: Optional[str] = None) -> bool:
        if not self.sources():
            return False
        level = level or self.level()
        return level is not None and self.find(level) is not None

    # -- building --------------------------------------------------------------------------------
    def build(self, force: bool = False, echo: Callable[[str], None] = print,
              levels: Optional[Sequence[str]] = None, into: Optional[Path] = None) -> Optional[Path]:
        """Compile every level (or ``levels``) unless built; returns the chosen level's path.

        The levels this CPU runs are compiled first. ``into``: build there (a wheel's folder)
        instead of the cache, copying a build the cache already has. ``ValueError`` for a bad
        ``XLAUNCH_CPU_ISA``, before anything is compiled.
        """
        if not self.sources():
            echo(f"{self.label}: no native sources; the pure-torch paths are used")
            return None
        level = self.level() if into is None else None
        wanted = tuple(levels or self.levels)
        runnable = set(isa.host_levels())
        wanted = tuple(sorted(wanted, key=lambda lv: (lv not in runnable, self.levels.index(lv))))
        folder = into or self.cache_dir()
        missing = {}
        for level in wanted:
            target = folder / self.file_name(level)
            cached = self.cache_dir() / target.name
            if into is not None and not force and cached.is_file() and not cached.is_symlink():
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(cached, target)
            if force or not target.is_file() or target.is_symlink() or untrusted(str(target)) or incomplete(target):
                missing[level] = (target, level_flags(self.namespace, level))
        if into is None:                  # before a build: a killed build's scratch, old keys' libraries
            removed, freed = tidy_cache(folder, self.stem, [self.file_name(level) for level in self.levels])
            if removed:
                echo(f"{self.label}: removed {removed} old build(s) from {folder} ({freed / 2**20:.1f} MiB)")
        if missing:
            compile_levels(self.csrc, self.sources(), missing, self.label, echo=echo)
        else:
            echo(f"{self.label}: native kernels already built at {', '.join(wanted)}: {folder}")
        return folder / self.file_name(level if level in wanted else wanted[0])

    # -- loading ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def prefer_native(self, enabled: Union[bool, str]) -> Iterator[None]:
        """Within the block: the chosen level (True), the pure-torch paths (False), or one level (a name)."""
        if isinstance(enabled, str) and enabled not in self.levels:
            raise ValueError(f"{self.label}: no compiled level {enabled!r}; it has: {', '.join(self.levels)}")
        saved, self._local.preference = self.preference, enabled
        try:
            yield
        finally:
            self._local.preference = saved

    @property
    def preference(self) -> Union[None, bool, str]:
        """This thread's innermost :meth:`prefer_native` (None: none, the default applies)."""
        return getattr(self._local, "preference", None)

    def ops(self) -> Optional[object]:
        """``torch.ops.<namespace>_<level>`` when the kernels are wanted and load, else None.

        ``ValueError`` (one line) for a ``disable_env`` other than 0 or 1: ``=false`` ran the kernels, unsaid."""
        preference = self.preference
        if preference is None:
            switch = os.environ.get(self.disable_env, "").strip()
            if switch not in ("", "0", "1"):
                raise ValueError(f"{self.disable_env}={switch}: expected 0 (the pure-torch paths) or 1 (the compiled "
                                 "kernels)")
            preference = switch != "0"
        if preference is False:
            return None
        level = preference if isinstance(preference, str) else self.level()
        return None if level is None else self.ops_at(level)

    def ops_at(self, level: str) -> Optional[object]:
        """One level's operators (loading its library once); None when it is not built.

        Raises ``RuntimeError`` for a level this CPU cannot execute: it is never loaded.
        """
        if level in self.loaded_levels:
            return self.loaded_levels[level]
        if level not in isa.host_levels():
            raise RuntimeError(f"{self.label}: this CPU cannot execute the {level} kernels "
                               f"(it runs: {', '.join(isa.host_levels()) or 'none'})")
        with self.lock:
            if level not in self.loaded_levels:
                self.loaded_levels[level] = self._load(level)
        return self.loaded_levels[level]

    def _load(self, level: str) -> Optional[object]:
        import torch

        path = self.find(level) if self.sources() else None
        if path is not None:
            try:
                if incomplete(path):
                    raise OSError(incomplete(path))
                torch.ops.load_library(str(path))
                ops = getattr(torch.ops, f"{self.namespace}_{level}")
                found = ops.compiled_isa() if hasattr(ops, "compiled_isa") else "no compiled_isa() operator"
                if found != level:          # another library under this one's name: its operators are not ours
                    raise RuntimeError(f"it is not the {level} library ({found})")
                return ops
            except (OSError, RuntimeError) as exc:
                warnings.warn(f"{self.label}: the native kernels at {path} do not load ({exc}); "
                              "using the pure-torch paths", RuntimeWarning,
                              stacklevel=stacklevel_outside("xlaunch", "torch"))
                return None
        if not self.warned and self.sources() and level in self.refused:
            self.warned = True
            warnings.warn(f"{self.label}: the native kernels found are not loaded: {self.refused[level]}, so another "
                          "user could have put them there; using the pure-torch paths", RuntimeWarning,
                          stacklevel=stacklevel_outside("xlaunch", "torch"))
        elif not self.warned and self.sources():
            self.warned = True
            warnings.warn(f"{self.label}: native kernels not built here; using the slower pure-torch paths "
                          f"(build them with `python -m {self.label}.native`)", RuntimeWarning,
                          stacklevel=stacklevel_outside("xlaunch", "torch"))
        return None

    def main(self, argv: Optional[list[str]] = None) -> int:
        """``python -m <package>.native [--force] [--path] [--host-only]``: build the kernels (or print where)."""
        import argparse

        parser = argparse.ArgumentParser(prog=f"python -m {self.label}.native",
                                         description=f"Build {self.label}'s C++ kernels at every ISA level.")
        parser.add_argument("--force", action="store_true", help="rebuild even when a build exists")
        parser.add_argument("--path", action="store_true", help="print each level's library and whether it is built")
        parser.add_argument("--host-only", action="store_true", help="only the levels this CPU can execute")
        args = parser.parse_args(argv)
        try:
            self.level()
        except ValueError as exc:           # a bad XLAUNCH_CPU_ISA: one line, nothing built
            _say(f"{parser.prog}: error: {exc}", "stderr")
            return 2
        if args.path:
            for level in self.levels:       # what a load would find: built, damaged, refused, or none
                found = self.find(level)
                damage = found and incomplete(found)
                state = (f"not loadable: {damage}" if damage else "built" if found else
                         f"refused: {self.refused[level]}" if level in self.refused else "not built")
                _say(f"{level}: {self.library_path(level)} ({state})")
            return 0
        with _stopped_by_signals():
            try:
                self.build(force=args.force, levels=self.runnable_levels() if args.host_only else None, echo=_say)
            except (RuntimeError, OSError) as exc:
                _say(f"{self.label}: warning: {exc}", "stderr")
                _say(f"{self.label}: the pure-torch paths will be used", "stderr")
                return 1
        return 0


def _say(line: str, stream: str = "stdout") -> None:
    """One line on ``sys.<stream>``. A full or closed stream, or a reader gone (``| head``), drops it and what
    follows (the descriptor then on /dev/null: the exit's flush cannot fail): output degrades, never the build."""
    handle = getattr(sys, stream)
    try:
        if handle is not None:
            print(line, file=handle, flush=True)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, handle.fileno())
            os.close(null)


_starting, _held = [False], []     # a compiler being started; the stop signals that came meanwhile


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (``kill``, a closed terminal, a set-up script giving up) end the build as Ctrl-C does:
    its compilers are killed and its scratch folder removed (by default they ran on, orphaned). A signal
    ignored (``nohup``) stays ignored."""
    def stop(signum: int, frame: object) -> None:
        if not _starting[0]:
            raise SystemExit(128 + signum)
        _held.append(signum)        # raised once the compiler being started is among those to kill

    main = threading.current_thread() is threading.main_thread()      # only there may a handler be set
    saved = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)
             if main and signal.getsignal(signum) == signal.SIG_DFL}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
