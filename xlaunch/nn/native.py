"""The compiled kernels of :mod:`xlaunch.nn`: built once per ISA level, the best this CPU runs loaded.

``make setup`` (or ``python -m xlaunch.nn.native``) compiles ``xlaunch/nn/csrc/*.cpp`` with the
system C++ compiler against the installed torch, once per ISA level (``baseline``, ``avx2``,
``avx512``; :mod:`xlaunch._isa_levels`), each into a library registering ``torch.ops.xlaunch_nn_<level>``.
The libraries live in a cache directory (``$XLAUNCH_NN_BUILD_DIR``, else
``$XDG_CACHE_HOME/xlaunch/nn``, else ``~/.cache/xlaunch/nn``; a wheel carries them in
``xlaunch/nn/prebuilt``) under names keyed by the sources, the torch version and the flags, so a
changed source or torch never loads a stale build. A process loads the best level its CPU
executes, capped by ``XLAUNCH_CPU_ISA``.

Every operator has a pure-torch path with the same results. It is used when the library is not
built (one warning per process says how to build it), when ``XLAUNCH_NN_NATIVE=0``, and inside
``prefer_native(False)``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

from xlaunch._isa_levels import LIBRARY_LEVELS
from xlaunch._native_build import Library, compiler  # noqa: F401  (compiler: part of this module's surface)
from xlaunch._torch import needs_torch

try:
    with needs_torch("xlaunch.nn.native"):        # by its name, also when run as __main__
        import torch  # noqa: F401  (the library registers torch.ops.xlaunch_nn)
except ImportError as exc:
    if __name__ != "__main__":
        raise
    sys.exit(f"python -m xlaunch.nn.native: {exc}")      # one line, exit status 1 (it was a traceback)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bag_forward.cpp", "bag_backward.cpp", "roi_align.cpp", "isa_level.cpp")
HEADERS = ("common.h", "bag_common.h")
LIBRARY_STEM = "xlaunch_nn_ops"
DISABLE_ENV = "XLAUNCH_NN_NATIVE"
BUILD_DIR_ENV = "XLAUNCH_NN_BUILD_DIR"

# No bf16- or AMX-specific code: an avx512_bf16 or amx CPU runs the avx512 library.
LEVELS = LIBRARY_LEVELS["xlaunch.nn"]
LIBRARY = Library("xlaunch.nn", LIBRARY_STEM, CSRC, "xlaunch_nn", DISABLE_ENV, BUILD_DIR_ENV, "nn",
                  sources=lambda: SOURCES, headers=lambda: HEADERS, levels=LEVELS)


def cache_dir() -> Path:
    """Where built libraries are kept."""
    return LIBRARY.cache_dir()


def build_key(level: Optional[str] = None) -> str:
    """Hash of everything one level's library depends on: sources, torch, flags (not this CPU)."""
    return LIBRARY.build_key(level)


def library_path(level: Optional[str] = None) -> Path:
    """Where ``level``'s library (default: the level this process uses) is, or would be built."""
    return LIBRARY.library_path(level)


def build(force: bool = False, echo: Callable[[str], None] = print, levels: Optional[tuple] = None) -> Path:
    """Compile every level's library (or ``levels``') unless built; returns the used level's path.

    Raises ``RuntimeError`` (with the compiler's output) when the compiler is missing or fails.
    The file is written next to its final name and renamed into place, never through a symlink.
    """
    built = LIBRARY.build(force=force, echo=echo, levels=levels)
    assert built is not None
    return built


def prefer_native(enabled: "bool | str") -> Iterator[None]:
    """Within the block: the compiled kernels (``True``), the pure-torch paths, or one level's kernels."""
    return LIBRARY.prefer_native(enabled)


def ops() -> Optional[object]:
    """``torch.ops.xlaunch_nn_<level>`` when the compiled kernels are wanted and loaded, else None."""
    return LIBRARY.ops()


def ops_at(level: str) -> Optional[object]:
    """One level's operators (None: not built); RuntimeError for a level this CPU cannot execute."""
    return LIBRARY.ops_at(level)


def level() -> Optional[str]:
    """The compiled level this process uses (``XLAUNCH_CPU_ISA`` caps it)."""
    return LIBRARY.level()


def runnable_levels() -> tuple:
    """The compiled levels this CPU can execute."""
    return LIBRARY.runnable_levels()


def available(level: Optional[str] = None) -> bool:
    """Whether ``level``'s (default: the used level's) library is built, without loading it."""
    return LIBRARY.available(level)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m xlaunch.nn.native [--force] [--path]``: build the kernels (or print where)."""
    return LIBRARY.main(argv)


if __name__ == "__main__":
    sys.exit(main())
