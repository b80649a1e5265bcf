"""Instruction-set facts: the flags of the first processor in ``<root>/proc/cpuinfo`` and,
live on x86-64, whether the kernel lets this process use AMX tiles (``arch_prctl``).

``/proc/cpuinfo`` is the fast path. py-cpuinfo (over a second per call) is only the live fallback
when that file is missing or has no flags line (non-Linux systems, odd sandboxes).
"""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

from xlaunch.machine._files import Notes, join, read_until_blank_line
from xlaunch.machine.model import Isa

# The flags xlaunch reports (``--check-isa``), as spelled in /proc/cpuinfo.
ISA_FLAGS = (
    "amx_bf16", "amx_int8", "amx_tile", "amx_fp16",
    "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
    "avx2", "fma",
)

SYS_ARCH_PRCTL = 158            # x86-64 syscall number
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def read_isa(root: str, live: bool, notes: Notes) -> Isa:
    path = join(root, "proc/cpuinfo")
    block = read_until_blank_line(path)
    if block is None:
        if live:
            return _isa_from_py_cpuinfo(notes, "proc/cpuinfo unreadable")
        notes.add("proc/cpuinfo unreadable; no ISA flags known")
        return Isa()
    fields: dict[str, str] = {}
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags_text = fields.get("flags", fields.get("Features"))   # x86 | arm64
    if flags_text is None:
        if live:
            return _isa_from_py_cpuinfo(notes, "proc/cpuinfo has no flags line")
        notes.add("proc/cpuinfo has no flags line; no ISA flags known")
    flags = frozenset((flags_text or "").split())
    amx: Optional[bool] = None
    if live:
        amx = amx_permitted(flags)
    return Isa(
        flags=flags,
        vendor=fields.get("vendor_id") or fields.get("CPU implementer"),
        model_name=fields.get("model name"),
        amx_permitted=amx,
    )


def _isa_from_py_cpuinfo(notes: Notes, why: str) -> Isa:
    """The slow live fallback: py-cpuinfo's CPUID-based flags (same spelling as cpuinfo)."""
    try:
        import cpuinfo   # py-cpuinfo; imported only here (slow)

        info = cpuinfo.get_cpu_info()
    except Exception as exc:   # any failure of a third-party probe just means "unknown"
        notes.add(f"{why}; py-cpuinfo fallback failed ({exc}); no ISA flags known")
        return Isa()
    flags = frozenset(str(flag) for flag in info.get("flags", ()))
    notes.add(f"{why}; ISA flags from py-cpuinfo")
    return Isa(flags=flags, vendor=info.get("vendor_id_raw"), model_name=info.get("brand_raw"),
               amx_permitted=amx_permitted(flags))


def amx_permitted(flags: frozenset[str]) -> Optional[bool]:
    """Whether this process may use AMX tile data, requesting it if not yet granted.

    False when the CPU has no ``amx_tile`` (the kernel cannot grant it); None off x86-64 Linux.
    """
    if "amx_tile" not in flags:
        return False
    if not hasattr(os, "uname") or os.uname().machine != "x86_64":
        return None
    import ctypes   # only on AMX machines: keeps the common launch path light

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        permitted = ctypes.c_ulong(0)
        if libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_PERM),
                        ctypes.byref(permitted)) == 0 and permitted.value & (1 << XFEATURE_XTILEDATA):
            return True
        return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                            ctypes.c_long(XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return None
