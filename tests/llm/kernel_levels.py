"""The compiled ISA levels of xlaunch.llm's kernels, one at a time, for tests/llm."""
from __future__ import annotations

import pytest

from xlaunch.llm import native


def use_level(level: str):
    """Within the block the kernels of ``level`` run (skipped: this CPU cannot, or not built)."""
    if level not in native.runnable_levels():
        pytest.skip(f"this CPU cannot execute the {level} kernels")
    if native.ops_at(level) is None:
        pytest.skip(f"the xlaunch.llm {level} kernels are not built (python -m xlaunch.llm.native)")
    assert native.ops_at(level).compiled_isa() == level
    return native.prefer_native(level)
