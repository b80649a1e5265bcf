"""Compiling the C++ operator libraries of :mod:`xlaunch.nn` and :mod:`xlaunch.llm` against the installed torch.

Which compiler, the key a build is stored under (sources, torch, compiler, flags, this CPU),
:func:`compile_library` (sources compiled in parallel, the library renamed into place, never
through a symlink), and :class:`Library`: one package's library, built and loaded once.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-DNDEBUG", "-w")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/xlaunch`` (else ``~/.cache/xlaunch``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlaunch"


def compiler() -> Optional[str]:
    """The C++ compiler to use (``$CXX``, else ``g++``/``c++`` on PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> str:
    """This CPU's feature flags from /proc/cpuinfo ('' when unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version`` ('' when it does not answer)."""
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.splitlines()[0] if done.stdout else ""


def build_key(csrc: Path, files: Sequence[str], cxx: Optional[str] = None, flags: Sequence[str] = FLAGS) -> str:
    """Hash of everything a library depends on: its files, torch, compiler, flags, CPU."""
    import torch

    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode())
        digest.update((csrc / name).read_bytes())
    cxx = cxx or compiler() or ""
    for part in (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), cxx, compiler_version(cxx) if cxx else "",
                 " ".join(flags), cpu_flags(), sys.platform):
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


def _run(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, what: str, cxx: str, label: str) -> None:
    output, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"compiling the {label} kernels failed ({Path(cxx).name} exit {process.returncode} "
                           f"on {what}):\n{output[-4000:]}")


def compile_library(csrc: Path, sources: Sequence[str], target: Path, label: str,
                    echo: Callable[[str], None] = print, cxx: Optional[str] = None,
                    flags: Sequence[str] = FLAGS) -> Path:
    """Compile ``sources`` (in ``csrc``) into the shared library ``target``, as many at once as there are CPUs.

    Raises ``RuntimeError`` (with the compiler's output) when the compiler is missing or fails, or
    when ``target``'s folder is a symlink. The library is linked next to its final name and renamed
    into place; a failure or an interrupt leaves no compiler running.
    """
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent.is_symlink():
        raise RuntimeError(f"refusing to build into {target.parent}: it is a symlink")
    compile_flags, link_flags = torch_flags(csrc, flags)
    parallel = max(1, min(len(sources), os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        objects, running = [], []
        echo(f"{label}: compiling {len(sources)} sources with {Path(cxx).name}, {parallel} at a time "
             "(about a minute) ...")
        try:
            for number, name in enumerate(sources, 1):
                objects.append(Path(scratch) / f"{Path(name).stem}.o")
                running.append((name, _run([cxx, *compile_flags, "-c", str(csrc / name), "-o", str(objects[-1])])))
                while len(running) >= parallel or (number == len(sources) and running):
                    done, process = running[0]
                    _finish(process, done, cxx, label)
                    running.pop(0)
                    echo(f"{label}: compiled {done}")
        finally:
            for _, process in running:
                process.kill()
                process.wait()
        partial = Path(scratch) / target.name
        _finish(_run([cxx, "-shared", *flags, *map(str, objects), *link_flags, "-o", str(partial)]), "linking", cxx,
                label)
        if target.is_symlink():
            target.unlink()
        os.replace(partial, target)
    return target


class Library:
    """One operator library: where it is built, building it, and loading it once per process.

    ``sources``/``headers`` are called each time (``xlaunch.llm`` compiles every ``csrc/*.cpp``);
    the build key covers them, torch, the compiler, the flags and this CPU, so a changed source,
    torch or machine never loads a stale build. Loading is lazy and thread-safe; a missing build
    warns once per process and the callers take their pure-torch paths.
    """

    def __init__(self, label: str, stem: str, csrc: Path, namespace: str, disable_env: str, build_dir_env: str,
                 cache_subdir: str, sources: Callable[[], Sequence[str]], headers: Callable[[], Sequence[str]]) -> None:
        self.label, self.stem, self.csrc, self.namespace = label, stem, csrc, namespace
        self.disable_env, self.build_dir_env, self.cache_subdir = disable_env, build_dir_env, cache_subdir
        self.sources, self.headers = sources, headers
        self.lock = threading.Lock()
        self.loaded: Optional[object] = None
        self.load_failed = False
        self.warned = False
        self.preference: Optional[bool] = None

    def cache_dir(self) -> Path:
        explicit = os.environ.get(self.build_dir_env)
        return Path(explicit) if explicit else cache_root() / self.cache_subdir

    def build_key(self, cxx: Optional[str] = None) -> str:
        return build_key(self.csrc, (*self.sources(), *self.headers()), cxx, FLAGS)

    def library_path(self, cxx: Optional[str] = None) -> Path:
        return self.cache_dir() / f"{self.stem}-{self.build_key(cxx)}.so"

    def available(self) -> bool:
        if not self.sources():
            return False
        path = self.library_path()
        return path.is_file() and not path.is_symlink()

    def build(self, force: bool = False, echo: Callable[[str], None] = print) -> Optional[Path]:
        """Compile unless a build for this key exists; returns its path (None: no sources)."""
        if not self.sources():
            echo(f"{self.label}: no native sources; the pure-torch paths are used")
            return None
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler found (set CXX or install g++)")
        target = self.library_path(cxx)
        if target.is_file() and not target.is_symlink() and not force:
            echo(f"{self.label}: native kernels already built: {target}")
            return target
        compile_library(self.csrc, self.sources(), target, self.label, echo=echo, cxx=cxx, flags=FLAGS)
        echo(f"{self.label}: native kernels built: {target}")
        return target

    @contextlib.contextmanager
    def prefer_native(self, enabled: bool) -> Iterator[None]:
        saved, self.preference = self.preference, enabled
        try:
            yield
        finally:
            self.preference = saved

    def ops(self) -> Optional[object]:
        """``torch.ops.<namespace>`` when the kernels are wanted and load, else None."""
        if self.preference is False or (self.preference is None and os.environ.get(self.disable_env, "1") == "0"):
            return None
        if self.loaded is not None or self.load_failed:
            return self.loaded
        with self.lock:
            if self.loaded is None and not self.load_failed:
                self._load()
        return self.loaded

    def _load(self) -> None:
        import torch

        path = self.library_path() if self.sources() else None
        if path is not None and path.is_file() and not path.is_symlink():
            try:
                torch.ops.load_library(str(path))
                self.loaded = getattr(torch.ops, self.namespace)
                return
            except (OSError, RuntimeError) as exc:
                self.load_failed = True
                warnings.warn(f"{self.label}: the native kernels at {path} do not load ({exc}); "
                              "using the pure-torch paths", RuntimeWarning, stacklevel=4)
                return
        self.load_failed = True
        if not self.warned and path is not None:
            self.warned = True
            warnings.warn(f"{self.label}: native kernels not built here; using the slower pure-torch paths "
                          f"(build them with `python -m {self.label}.native`)", RuntimeWarning, stacklevel=4)

    def main(self, argv: Optional[list[str]] = None) -> int:
        """``python -m <package>.native [--force] [--path]``: build the kernels (or print where)."""
        import argparse

        parser = argparse.ArgumentParser(prog=f"python -m {self.label}.native",
                                         description=f"Build {self.label}'s C++ kernels for this machine.")
        parser.add_argument("--force", action="store_true", help="rebuild even when a build exists")
        parser.add_argument("--path", action="store_true", help="print the library path and whether it is built")
        args = parser.parse_args(argv)
        if args.path:
            print(f"{self.library_path()} ({'built' if self.available() else 'not built'})")
            return 0
        try:
            self.build(force=args.force)
        except RuntimeError as exc:
            print(f"{self.label}: warning: {exc}", file=sys.stderr)
            print(f"{self.label}: the pure-torch paths will be used", file=sys.stderr)
            return 1
        return 0
