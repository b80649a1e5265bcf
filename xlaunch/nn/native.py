"""The compiled kernels of :mod:`xlaunch.nn`: built once per machine, loaded when present.

``make setup`` (or ``python -m xlaunch.nn.native``) compiles ``xlaunch/nn/csrc/*.cpp`` with the
system C++ compiler against the installed torch into one shared library registering the
``torch.ops.xlaunch_nn`` operators. The library lives in a cache directory
(``$XLAUNCH_NN_BUILD_DIR``, else ``$XDG_CACHE_HOME/xlaunch/nn``, else ``~/.cache/xlaunch/nn``)
under a name keyed by the sources, the torch version, the compiler and this CPU's flags (it is
built with ``-march=native``), so a changed source, torch or machine never loads a stale build.

Every operator has a pure-torch path with the same results. It is used when the library is not
built (one warning per process says how to build it), when ``XLAUNCH_NN_NATIVE=0``, and inside
``prefer_native(False)``.
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
from typing import Callable, Iterator, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bag_forward.cpp", "bag_backward.cpp", "roi_align.cpp")
HEADERS = ("common.h", "bag_common.h")
LIBRARY_STEM = "xlaunch_nn_ops"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-DNDEBUG", "-w")
DISABLE_ENV = "XLAUNCH_NN_NATIVE"
BUILD_DIR_ENV = "XLAUNCH_NN_BUILD_DIR"

_lock = threading.Lock()
_loaded: Optional[object] = None
_load_failed = False
_warned = False
_preference: Optional[bool] = None


def cache_dir() -> Path:
    """Where built libraries are kept."""
    explicit = os.environ.get(BUILD_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlaunch" / "nn"


def compiler() -> Optional[str]:
    """The C++ compiler to use (``$CXX``, else ``g++``/``c++`` on PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.splitlines()[0] if done.stdout else ""


def build_key(cxx: Optional[str] = None) -> str:
    """Hash of everything the library depends on: sources, torch, compiler, flags, CPU."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    cxx = cxx or compiler() or ""
    for part in (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), cxx, _compiler_version(cxx) if cxx else "",
                 " ".join(FLAGS), _cpu_flags(), sys.platform):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def library_path(cxx: Optional[str] = None) -> Path:
    """The path the library for this source, torch, compiler and CPU is (or would be) built at."""
    return cache_dir() / f"{LIBRARY_STEM}-{build_key(cxx)}.so"


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for an extension of the installed torch."""
    from torch.utils import cpp_extension

    lib = Path(torch.__file__).resolve().parent / "lib"
    compile_flags = [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     *(f"-I{path}" for path in cpp_extension.include_paths()), f"-I{CSRC}"]
    return compile_flags, [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _run(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen, what: str, cxx: str) -> None:
    output, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"compiling the xlaunch.nn kernels failed ({Path(cxx).name} exit {process.returncode} "
                           f"on {what}):\n{output[-4000:]}")


def build(force: bool = False, echo: Callable[[str], None] = print) -> Path:
    """Compile the library unless a build for this key exists; returns its path.

    Raises ``RuntimeError`` (with the compiler's output) when the compiler is missing or fails.
    The file is written next to its final name and renamed into place, never through a symlink.
    """
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    target = library_path(cxx)
    if target.is_file() and not target.is_symlink() and not force:
        echo(f"xlaunch.nn: native kernels already built: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent.is_symlink():
        raise RuntimeError(f"refusing to build into {target.parent}: it is a symlink")
    compile_flags, link_flags = _torch_flags()
    parallel = max(1, min(len(SOURCES), os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        objects, running = [], []
        echo(f"xlaunch.nn: compiling {len(SOURCES)} sources with {Path(cxx).name}, {parallel} at a time "
             "(about a minute) ...")
        try:
            for number, name in enumerate(SOURCES, 1):
                objects.append(Path(scratch) / f"{Path(name).stem}.o")
                running.append((name, _run([cxx, *compile_flags, "-c", str(CSRC / name), "-o", str(objects[-1])])))
                while len(running) >= parallel or (number == len(SOURCES) and running):
                    done, process = running[0]
                    _finish(process, done, cxx)
                    running.pop(0)
                    echo(f"xlaunch.nn: compiled {done}")
        finally:   # a failure or an interrupt leaves no compiler running
            for _, process in running:
                process.kill()
                process.wait()
        partial = Path(scratch) / target.name
        _finish(_run([cxx, "-shared", *FLAGS, *map(str, objects), *link_flags, "-o", str(partial)]), "linking", cxx)
        if target.is_symlink():
            target.unlink()
        os.replace(partial, target)
    echo(f"xlaunch.nn: native kernels built: {target}")
    return target


@contextlib.contextmanager
def prefer_native(enabled: bool) -> Iterator[None]:
    """Within the block, use the compiled kernels (``True``, when built) or the pure-torch paths."""
    global _preference
    saved, _preference = _preference, enabled
    try:
        yield
    finally:
        _preference = saved


def ops() -> Optional[object]:
    """``torch.ops.xlaunch_nn`` when the compiled kernels are wanted and loaded, else None."""
    global _loaded, _load_failed, _warned
    if _preference is False or (_preference is None and os.environ.get(DISABLE_ENV, "1") == "0"):
        return None
    if _loaded is not None:
        return _loaded
    if _load_failed:
        return None
    with _lock:
        if _loaded is None and not _load_failed:
            path = library_path()
            if path.is_file() and not path.is_symlink():
                try:
                    torch.ops.load_library(str(path))
                    _loaded = torch.ops.xlaunch_nn
                except (OSError, RuntimeError) as exc:
                    _load_failed = True
                    warnings.warn(f"xlaunch.nn: the native kernels at {path} do not load ({exc}); "
                                  "using the pure-torch paths", RuntimeWarning, stacklevel=3)
            else:
                _load_failed = True
                if not _warned:
                    _warned = True
                    warnings.warn("xlaunch.nn: native kernels not built here; using the slower pure-torch paths "
                                  "(build them with `python -m xlaunch.nn.native`)", RuntimeWarning, stacklevel=3)
    return _loaded


def available() -> bool:
    """Whether the compiled kernels are built for this machine (without loading them)."""
    path = library_path()
    return path.is_file() and not path.is_symlink()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m xlaunch.nn.native [--force] [--path]``: build the kernels (or print where)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m xlaunch.nn.native", description=main.__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even when a build exists")
    parser.add_argument("--path", action="store_true", help="print the library path and whether it is built")
    args = parser.parse_args(argv)
    if args.path:
        print(f"{library_path()} ({'built' if available() else 'not built'})")
        return 0
    try:
        build(force=args.force)
    except RuntimeError as exc:
        print(f"xlaunch.nn: warning: {exc}", file=sys.stderr)
        print("xlaunch.nn: the pure-torch paths will be used", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
