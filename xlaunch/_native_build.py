"""Compiling the C++ operator libraries of :mod:`xlaunch.nn` and :mod:`xlaunch.llm` against the installed torch.

Stateless helpers: which compiler, the key a build is stored under (sources, torch, compiler,
flags, this CPU), and :func:`compile_library`, which compiles sources in parallel and renames the
library into place (never through a symlink). Each package keeps its own loading state.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

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
