"""The ISA levels xlaunch's C++ kernels are compiled at, and the one this process runs.

Every native library is compiled once per level (``-march`` below); at load the best level this
CPU can execute is chosen, capped by ``XLAUNCH_CPU_ISA``. What the CPU can execute comes from the
``flags`` line of ``/proc/cpuinfo``: Linux lists a feature there only when the OS has enabled its
register state (XSAVE/xgetbv: an AVX-512 CPU whose kernel does not save the ZMM state shows no
``avx512f``), so the line is cpuid filtered by the OS's grant. The ``amx`` level asks for no tile
permission (``arch_prctl``): no kernel uses AMX tiles yet, so it runs the best lower library
(:data:`LIBRARY_LEVELS`); a kernel that does will need :func:`xlaunch.machine.isa.amx_permitted`.
No torch, no subprocess: this is on the launcher's path (``xlaunch --check-isa``).
"""
from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterable, Optional

CAP_ENV = "XLAUNCH_CPU_ISA"

# Lowest first. The flags are /proc/cpuinfo's spelling of what the -march level may emit.
LEVELS = ("baseline", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
REQUIRES = {
    "baseline": (),
    "avx2": ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"),          # x86-64-v3
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),          # x86-64-v4
    "avx512_vnni": ("avx512_vnni",),                                                # Cascade Lake, Ice Lake
    "avx512_bf16": ("avx512_bf16",),                                                # Cooper Lake, Zen 4, SPR
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
MARCH = {
    "baseline": ("-march=x86-64", "-mtune=generic"),
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "avx512": ("-march=x86-64-v4", "-mtune=generic"),
    "avx512_vnni": ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mtune=generic"),
    "amx": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8",
            "-mtune=generic"),
}

# The levels each library is compiled at (a higher CPU level runs the best of them):
# xlaunch.nn has no VNNI-, bf16- or AMX-specific code; no xlaunch.llm kernel uses AMX yet.
LIBRARY_LEVELS = {
    "xlaunch.nn": ("baseline", "avx2", "avx512"),
    "xlaunch.llm": ("baseline", "avx2", "avx512", "avx512_vnni", "avx512_bf16"),
}


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The first processor's flags (empty when unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


_host: dict = {}      # this process's levels, read once (every kernel call asks)


def host_levels(flags: "Optional[Iterable[str]]" = None) -> tuple:
    """The levels a CPU with ``flags`` (default: this one, and its OS) executes, lowest first.

    Each level needs every level below it.
    """
    if flags is None:
        if "levels" not in _host:
            x86 = os.uname().machine in ("x86_64", "AMD64")
            _host["levels"] = host_levels(cpu_flags()) if x86 else ()
        return _host["levels"]
    have = frozenset(flags)
    levels = []
    for level in LEVELS:
        if not all(flag in have for flag in REQUIRES[level]):
            break
        levels.append(level)
    return tuple(levels)


def chosen_level(flags: "Optional[Iterable[str]]" = None, cap: "Optional[str]" = None) -> "Optional[str]":
    """The best level this CPU runs, capped by ``cap`` (default ``$XLAUNCH_CPU_ISA``); None off x86-64.

    Raises ``ValueError`` (one line) for an unknown cap or one above what the CPU can execute.
    """
    cap = os.environ.get(CAP_ENV, "") if cap is None else cap
    levels = host_levels(flags)
    cap = cap.strip().lower()
    if cap:
        if cap not in LEVELS:
            raise ValueError(f"{CAP_ENV}={cap}: unknown ISA level; valid: {', '.join(LEVELS)}")
        if cap not in levels:
            have = ", ".join(levels) if levels else "none (not x86-64)"
            raise ValueError(f"{CAP_ENV}={cap}: this CPU cannot execute it; it runs: {have}")
        return cap
    return levels[-1] if levels else None


def multiplies_bf16(level: str) -> bool:
    """Whether kernels built for ``level`` multiply bf16 natively (``vdpbf16ps``: ``avx512_bf16`` and above); below,
    they widen bf16 to fp32."""
    return LEVELS.index(level) >= LEVELS.index("avx512_bf16")


def library_level(level: str, compiled: "Iterable[str]") -> str:
    """The compiled level a library uses at ``level``: the best of ``compiled`` not above it."""
    compiled = tuple(compiled)
    best = compiled[0]
    for candidate in compiled:
        if LEVELS.index(candidate) <= LEVELS.index(level):
            best = candidate
    return best


def kernel_levels(flags: "Iterable[str]") -> dict:
    """``--check-isa``'s view: the level each library runs at on a CPU with ``flags``, under the cap."""
    cap = os.environ.get(CAP_ENV, "").strip() or None
    try:
        level = chosen_level(flags)
    except ValueError as exc:
        return {"level": None, "cap": cap, "error": str(exc), "libraries": {}}
    libraries = {name: library_level(level, levels) for name, levels in LIBRARY_LEVELS.items()} if level else {}
    return {"level": level, "cap": cap, "error": None, "libraries": libraries}
