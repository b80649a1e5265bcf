"""The compiled kernels of :mod:`xlaunch.llm`: built once per machine, loaded when present.

``make setup`` (or ``python -m xlaunch.llm.native``) compiles every ``xlaunch/llm/csrc/*.cpp``
against the installed torch (with ``-march=native``) into one library registering the
``torch.ops.xlaunch_llm`` operators, kept under ``$XLAUNCH_LLM_BUILD_DIR`` (else
``~/.cache/xlaunch/llm``) by a key of the sources, torch, compiler and CPU flags.

Every operator has a pure-torch path with the same semantics, used when the library is not built
(one warning per process), when ``XLAUNCH_LLM_NATIVE=0``, and inside ``prefer_native(False)``.
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
LIBRARY_STEM = "xlaunch_llm_ops"
DISABLE_ENV = "XLAUNCH_LLM_NATIVE"
BUILD_DIR_ENV = "XLAUNCH_LLM_BUILD_DIR"

_lock = threading.Lock()
_loaded: Optional[object] = None
_load_failed = False
_warned = False
_preference: Optional[bool] = None


def sources() -> tuple[str, ...]:
    """The C++ sources compiled into the library (every ``csrc/*.cpp``)."""
    return tuple(sorted(path.name for path in CSRC.glob("*.cpp")))


def headers() -> tuple[str, ...]:
    return tuple(sorted(path.name for path in CSRC.glob("*.h")))


def cache_dir() -> Path:
    """Where built libraries are kept."""
    explicit = os.environ.get(BUILD_DIR_ENV)
    return Path(explicit) if explicit else cache_root() / "llm"


def library_path(cxx: Optional[str] = None) -> Path:
    """The path the library for these sources, torch, compiler and CPU is (or would be) built at."""
    return cache_dir() / f"{LIBRARY_STEM}-{_build.build_key(CSRC, (*sources(), *headers()), cxx, FLAGS)}.so"


def build(force: bool = False, echo: Callable[[str], None] = print) -> Optional[Path]:
    """Compile the library unless a build for this key exists; returns its path (None: no sources)."""
    if not sources():
        echo("xlaunch.llm: no native sources; the pure-torch paths are used")
        return None
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    target = library_path(cxx)
    if target.is_file() and not target.is_symlink() and not force:
        echo(f"xlaunch.llm: native kernels already built: {target}")
        return target
    _build.compile_library(CSRC, sources(), target, "xlaunch.llm", echo=echo, cxx=cxx, flags=FLAGS)
    echo(f"xlaunch.llm: native kernels built: {target}")
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
    """``torch.ops.xlaunch_llm`` when the compiled kernels are wanted and loaded, else None."""
    global _loaded, _load_failed, _warned
    if _preference is False or (_preference is None and os.environ.get(DISABLE_ENV, "1") == "0"):
        return None
    if _loaded is not None:
        return _loaded
    if _load_failed:
        return None
    with _lock:
        if _loaded is None and not _load_failed:
            path = library_path() if sources() else None
            if path is not None and path.is_file() and not path.is_symlink():
                try:
                    torch.ops.load_library(str(path))
                    _loaded = torch.ops.xlaunch_llm
                except (OSError, RuntimeError) as exc:
                    _load_failed = True
                    warnings.warn(f"xlaunch.llm: the native kernels at {path} do not load ({exc}); "
                                  "using the pure-torch paths", RuntimeWarning, stacklevel=3)
            else:
                _load_failed = True
                if not _warned and path is not None:
                    _warned = True
                    warnings.warn("xlaunch.llm: native kernels not built here; using the slower pure-torch paths "
                                  "(build them with `python -m xlaunch.llm.native`)", RuntimeWarning, stacklevel=3)
    return _loaded


def available() -> bool:
    """Whether the compiled kernels are built for this machine (without loading them)."""
    if not sources():
        return False
    path = library_path()
    return path.is_file() and not path.is_symlink()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m xlaunch.llm.native [--force] [--path]``: build the kernels (or print where)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m xlaunch.llm.native", description=main.__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even when a build exists")
    parser.add_argument("--path", action="store_true", help="print the library path and whether it is built")
    args = parser.parse_args(argv)
    if args.path:
        print(f"{library_path()} ({'built' if available() else 'not built'})")
        return 0
    try:
        build(force=args.force)
    except RuntimeError as exc:
        print(f"xlaunch.llm: warning: {exc}", file=sys.stderr)
        print("xlaunch.llm: the pure-torch paths will be used", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
