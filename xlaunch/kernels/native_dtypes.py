"""Does this CPU compute bf16/fp16 natively? The one answer (and reason text) for every room.

bf16 is native with AVX512_BF16 or AMX_BF16, fp16 with AVX512_FP16 or AMX_FP16; elsewhere oneDNN
emulates them through fp32 conversions and they run slower than fp32 (measured on an AVX2-only
EPYC: a small CNN 60x slower under bf16 autocast, a split-bf16 MLP training step 6-18x an fp32 one).
``optimize()`` (:mod:`.optimize.precision`) falls back to fp32 on that answer; ``to_fused``
(:mod:`.optim.fused`) warns with it. Imports no torch.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")


class EmulatedPrecisionWarning(UserWarning):
    """bf16/fp16 was asked for where the CPU only emulates it (slower than fp32)."""


@functools.lru_cache(maxsize=1)
def isa_flags() -> frozenset[str]:
    """The CPU flags oneDNN may use: the machine model's (``current_machine().isa``, else
    /proc/cpuinfo), less what ``ONEDNN_MAX_CPU_ISA`` puts above oneDNN's ceiling."""
    from xlaunch.machine.isa import onednn_flags

    flags: frozenset[str] = frozenset()
    try:
        from xlaunch.machine import current_machine  # type: ignore[attr-defined]

        flags = frozenset(current_machine().isa.flags)
    except Exception:
        pass
    return onednn_flags(flags or flags_from_cpuinfo(Path("/proc/cpuinfo")))


def flags_from_cpuinfo(path: Path) -> frozenset[str]:
    """The ``flags`` line of the first processor in a cpuinfo file (empty when unreadable)."""
    try:
        with path.open() as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _unsupported_reason(name: str, native: tuple[str, str], flags: frozenset[str]) -> Optional[str]:
    """None when one of the ``native`` flags is present, else why ``name`` should not be used."""
    if any(flag in flags for flag in native):
        return None
    if not flags:
        return f"the CPU flags could not be read, so native {name} support is unknown"
    ceiling = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip()
    if ceiling and ceiling.upper() != "ALL":   # the flags were capped (isa_flags): the CPU may have them
        return (f"oneDNN may use neither {native[0].upper()} nor {native[1].upper()} under "
                f"ONEDNN_MAX_CPU_ISA={ceiling}, so {name} matmuls/convolutions are emulated and slower than fp32")
    return (f"this CPU has neither {native[0].upper()} nor {native[1].upper()}, so {name} "
            "matmuls/convolutions are emulated and slower than fp32")


def bf16_unsupported_reason(flags: frozenset[str]) -> Optional[str]:
    """None when bf16 runs natively, else why it should not be used."""
    return _unsupported_reason("bf16", BF16_FLAGS, flags)


def fp16_unsupported_reason(flags: frozenset[str]) -> Optional[str]:
    """None when fp16 runs natively, else why it should not be used."""
    return _unsupported_reason("fp16", FP16_FLAGS, flags)
