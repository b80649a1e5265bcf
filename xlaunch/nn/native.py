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

import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

from xlaunch._native_build import Library, compiler  # noqa: F401  (compiler: part of this module's surface)
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch  # noqa: F401  (the library registers torch.ops.xlaunch_nn)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bag_forward.cpp", "bag_backward.cpp", "roi_align.cpp")
HEADERS = ("common.h", "bag_common.h")
LIBRARY_STEM = "xlaunch_nn_ops"
DISABLE_ENV = "XLAUNCH_NN_NATIVE"
BUILD_DIR_ENV = "XLAUNCH_NN_BUILD_DIR"

LIBRARY = Library("xlaunch.nn", LIBRARY_STEM, CSRC, "xlaunch_nn", DISABLE_ENV, BUILD_DIR_ENV, "nn",
                  sources=lambda: SOURCES, headers=lambda: HEADERS)


def cache_dir() -> Path:
    """Where built libraries are kept."""
    return LIBRARY.cache_dir()


def build_key(cxx: Optional[str] = None) -> str:
    """Hash of everything the library depends on: sources, torch, compiler, flags, CPU."""
    return LIBRARY.build_key(cxx)


def library_path(cxx: Optional[str] = None) -> Path:
    """The path the library for this source, torch, compiler and CPU is (or would be) built at."""
    return LIBRARY.library_path(cxx)


def build(force: bool = False, echo: Callable[[str], None] = print) -> Path:
    """Compile the library unless a build for this key exists; returns its path.

    Raises ``RuntimeError`` (with the compiler's output) when the compiler is missing or fails.
    The file is written next to its final name and renamed into place, never through a symlink.
    """
    built = LIBRARY.build(force=force, echo=echo)
    assert built is not None
    return built


def prefer_native(enabled: bool) -> Iterator[None]:
    """Within the block, use the compiled kernels (``True``, when built) or the pure-torch paths."""
    return LIBRARY.prefer_native(enabled)


def ops() -> Optional[object]:
    """``torch.ops.xlaunch_nn`` when the compiled kernels are wanted and loaded, else None."""
    return LIBRARY.ops()


def available() -> bool:
    """Whether the compiled kernels are built for this machine (without loading them)."""
    return LIBRARY.available()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m xlaunch.nn.native [--force] [--path]``: build the kernels (or print where)."""
    return LIBRARY.main(argv)


if __name__ == "__main__":
    sys.exit(main())
