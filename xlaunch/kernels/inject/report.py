"""The words ``--auto-optimize`` says about a model's optimized copy (its verbose line, its summary reason)."""
from __future__ import annotations

from typing import Any


def describe(report: Any, engine: Any = None) -> str:
    """The engine route taken, else what the torch rewrite did to the copy (folded BN, bf16...)."""
    if engine is not None:
        return f"backend {engine.backend} ({engine.reason}; cache {engine.cache})"
    if report is None:
        return "done"
    parts = []
    if report.folded:
        parts.append(f"folded {len(report.folded)} BN")
    if report.dropouts_removed:
        parts.append(f"removed {len(report.dropouts_removed)} dropout")
    if report.channels_last_convs:
        parts.append(f"channels_last on {report.channels_last_convs} conv")
    if report.bf16_modules or report.autocast:
        parts.append(f"bf16 ({report.bf16_modules} modules, autocast {'on' if report.autocast else 'off'})")
    if report.frozen_with:
        parts.append(f"frozen with {report.frozen_with}")
    return ", ".join(parts) or "nothing applicable"
