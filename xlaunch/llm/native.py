"""The compiled kernels of :mod:`xlaunch.llm`: built once per ISA level, the best this CPU runs loaded.

``make setup`` (or ``python -m xlaunch.llm.native``) compiles every ``xlaunch/llm/csrc/*.cpp``
against the installed torch once per ISA level (``baseline``, ``avx2``, ``avx512``,
``avx512_vnni``, ``avx512_bf16``), each into a library registering ``torch.ops.xlaunch_llm_<level>``, kept under
``$XLAUNCH_LLM_BUILD_DIR`` (else ``~/.cache/xlaunch/llm``; a wheel's in ``xlaunch/llm/prebuilt``)
by a key of the sources, torch and flags. A process loads the best level its CPU executes, capped
by ``XLAUNCH_CPU_ISA``.

Every operator has a pure-torch path with the same semantics, used when the library is not built
(one warning per process), when ``XLAUNCH_LLM_NATIVE=0``, and inside ``prefer_native(False)``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from xlaunch._isa_levels import LIBRARY_LEVELS
from xlaunch._native_build import SHARED_SOURCES, Library
from xlaunch._torch import needs_torch

try:
    with needs_torch("xlaunch.llm.native"):        # by its name, also when run as __main__
        import torch  # noqa: F401  (the library registers torch.ops.xlaunch_llm)
except ImportError as exc:
    if __name__ != "__main__":
        raise
    sys.exit(f"python -m xlaunch.llm.native: {exc}")      # one line, exit status 1 (it was a traceback)

CSRC = Path(__file__).resolve().parent / "csrc"
LIBRARY_STEM = "xlaunch_llm_ops"
DISABLE_ENV = "XLAUNCH_LLM_NATIVE"
BUILD_DIR_ENV = "XLAUNCH_LLM_BUILD_DIR"


def sources() -> tuple[str, ...]:
    """The C++ sources compiled into the library (every ``csrc/*.cpp``, and the shared ``isa_level.cpp``)."""
    return tuple(sorted({*(path.name for path in CSRC.glob("*.cpp")), *SHARED_SOURCES}))


def headers() -> tuple[str, ...]:
    return tuple(sorted(path.name for path in CSRC.glob("*.h")))


# No kernel uses AMX yet: an AMX CPU runs the avx512_bf16 library.
LEVELS = LIBRARY_LEVELS["xlaunch.llm"]
LIBRARY = Library("xlaunch.llm", LIBRARY_STEM, CSRC, "xlaunch_llm", DISABLE_ENV, BUILD_DIR_ENV, "llm",
                  sources=sources, headers=headers, levels=LEVELS)


# The module's surface is the library's: where it is built, building it, using it or not.
cache_dir, library_path, build = LIBRARY.cache_dir, LIBRARY.library_path, LIBRARY.build
prefer_native, ops, available, main = LIBRARY.prefer_native, LIBRARY.ops, LIBRARY.available, LIBRARY.main
ops_at, level, runnable_levels = LIBRARY.ops_at, LIBRARY.level, LIBRARY.runnable_levels


if __name__ == "__main__":
    sys.exit(main())
