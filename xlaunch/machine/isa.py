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
    block = read_until_blank_line(path, notes=notes)
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


# oneDNN's ceiling (``ONEDNN_MAX_CPU_ISA``, formerly ``DNNL_MAX_CPU_ISA``; read once, at oneDNN's first
# use): the flags each value leaves to oneDNN's kernels. oneDNN's ISAs are not one line: AVX512_CORE
# is AVX2 plus AVX-512, without AVX-VNNI; the FP16 level (AVX10_1_512) takes in AVX-VNNI(-INT8).
_AVX2 = frozenset({"sse4_1", "avx", "avx2", "fma", "f16c"})
_AVX2_VNNI_2 = _AVX2 | {"avx_vnni", "avx_vnni_int8", "avx_ne_convert"}
_AVX512_CORE = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
_AVX512_BF16 = _AVX512_CORE | {"avx512_vnni", "avx512_bf16"}
_AVX512_FP16 = _AVX512_BF16 | _AVX2_VNNI_2 | {"avx512_fp16"}
_ONEDNN_LEVELS = {
    "SSE41": frozenset({"sse4_1"}), "AVX": frozenset({"sse4_1", "avx"}), "AVX2": _AVX2,
    "AVX2_VNNI": _AVX2 | {"avx_vnni"}, "AVX2_VNNI_2": _AVX2_VNNI_2,
    "AVX512_CORE": _AVX512_CORE, "AVX512_CORE_VNNI": _AVX512_CORE | {"avx512_vnni"},
    "AVX512_CORE_BF16": _AVX512_BF16, "AVX10_1_512": _AVX512_FP16,
    "AVX10_1_512_AMX": _AVX512_FP16 | {"amx_tile", "amx_int8", "amx_bf16"},
    "AVX10_1_512_AMX_FP16": _AVX512_FP16 | {"amx_tile", "amx_int8", "amx_bf16", "amx_fp16"},
}
_ONEDNN_ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX",
                   "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16"}
_ONEDNN_GOVERNED = frozenset().union(*_ONEDNN_LEVELS.values())
ONEDNN_CEILING_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def onednn_flags(flags: frozenset[str], environ: "Optional[dict[str, str]]" = None) -> frozenset[str]:
    """The CPU flags oneDNN's kernels may use in a process started with ``environ`` (default: this
    one's): all of them, or, under ``ONEDNN_MAX_CPU_ISA=AVX2`` and the like, none above that level.
    The routes that depend on VNNI, BF16 or AMX (INT8 ranges, bf16 engines) ask this, so a run under
    the ceiling on an AVX-512 machine chooses what an AVX2 machine would. An unknown value (oneDNN
    ignores it) or ``ALL``/``DEFAULT`` leaves the flags as they are. Other AVX-512 and AMX flags
    than oneDNN's levels name go with the first level of their family."""
    env = os.environ if environ is None else environ
    value = next((env[name] for name in ONEDNN_CEILING_ENV if env.get(name)), "").strip().upper()
    allowed = _ONEDNN_LEVELS.get(_ONEDNN_ALIASES.get(value, value))
    if allowed is None:
        return flags
    avx512, amx = "avx512f" in allowed, "amx_tile" in allowed
    return frozenset(flag for flag in flags if flag in allowed or (
        flag not in _ONEDNN_GOVERNED and not (flag.startswith("avx512") and not avx512)
        and not (flag.startswith("amx") and not amx)))
