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
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

from xlaunch import _native_build as _build
from xlaunch._native_build import FLAGS, cache_root, compiler
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bag_forward.cpp", "bag_backward.cpp", "roi_align.cpp")
HEADERS = ("common.h", "bag_common.h")
LIBRARY_STEM = "xlaunch_nn_ops"
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
    return Path(explicit) if explicit else cache_root() / "nn"


def build_key(cxx: Optional[str] = None) -> str:
    """Hash of everything the library depends on: sources, torch, compiler, flags, CPU."""
    return _build.build_key(CSRC, (*SOURCES, *HEADERS), cxx, FLAGS)


def library_path(cxx: Optional[str] = None) -> Path:
    """The path the library for this source, torch, compiler and CPU is (or would be) built at."""
    return cache_dir() / f"{LIBRARY_STEM}-{build_key(cxx)}.so"


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
    _build.compile_library(CSRC, SOURCES, target, "xlaunch.nn", echo=echo, cxx=cxx, flags=FLAGS)
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
