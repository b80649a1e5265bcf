"""The compiled kernels of :mod:`xlaunch.llm`: built once per machine, loaded when present.

``make setup`` (or ``python -m xlaunch.llm.native``) compiles every ``xlaunch/llm/csrc/*.cpp``
against the installed torch (with ``-march=native``) into one library registering the
``torch.ops.xlaunch_llm`` operators, kept under ``$XLAUNCH_LLM_BUILD_DIR`` (else
``~/.cache/xlaunch/llm``) by a key of the sources, torch, compiler and CPU flags.

Every operator has a pure-torch path with the same semantics, used when the library is not built
(one warning per process), when ``XLAUNCH_LLM_NATIVE=0``, and inside ``prefer_native(False)``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

from xlaunch._native_build import Library
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch  # noqa: F401  (the library registers torch.ops.xlaunch_llm)

CSRC = Path(__file__).resolve().parent / "csrc"
LIBRARY_STEM = "xlaunch_llm_ops"
DISABLE_ENV = "XLAUNCH_LLM_NATIVE"
BUILD_DIR_ENV = "XLAUNCH_LLM_BUILD_DIR"


def sources() -> tuple[str, ...]:
    """The C++ sources compiled into the library (every ``csrc/*.cpp``)."""
    return tuple(sorted(path.name for path in CSRC.glob("*.cpp")))


def headers() -> tuple[str, ...]:
    return tuple(sorted(path.name for path in CSRC.glob("*.h")))


LIBRARY = Library("xlaunch.llm", LIBRARY_STEM, CSRC, "xlaunch_llm", DISABLE_ENV, BUILD_DIR_ENV, "llm",
                  sources=sources, headers=headers)


def cache_dir() -> Path:
    """Where built libraries are kept."""
    return LIBRARY.cache_dir()


def library_path(cxx: Optional[str] = None) -> Path:
    """The path the library for these sources, torch, compiler and CPU is (or would be) built at."""
    return LIBRARY.library_path(cxx)


def build(force: bool = False, echo: Callable[[str], None] = print) -> Optional[Path]:
    """Compile the library unless a build for this key exists; returns its path (None: no sources)."""
    return LIBRARY.build(force=force, echo=echo)


def prefer_native(enabled: bool) -> Iterator[None]:
    """Within the block, use the compiled kernels (``True``, when built) or the pure-torch paths."""
    return LIBRARY.prefer_native(enabled)


def ops() -> Optional[object]:
    """``torch.ops.xlaunch_llm`` when the compiled kernels are wanted and loaded, else None."""
    return LIBRARY.ops()


def available() -> bool:
    """Whether the compiled kernels are built for this machine (without loading them)."""
    return LIBRARY.available()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m xlaunch.llm.native [--force] [--path]``: build the kernels (or print where)."""
    return LIBRARY.main(argv)


if __name__ == "__main__":
    sys.exit(main())
