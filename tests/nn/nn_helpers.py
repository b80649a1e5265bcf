"""Shared by tests/nn: run a test on the compiled kernels and on the pure-torch paths.

``kernels`` is a fixture parametrized over both; the compiled one needs the library that
``make setup`` builds (skipped locally without it, a failure under CI, as system libraries are).
"""
from __future__ import annotations

import os

import pytest
from conftest import require

torch = pytest.importorskip("torch")

from xlaunch.nn import native  # noqa: E402


@pytest.fixture(params=["native", "torch"])
def kernels(request) -> str:
    """``"native"`` (the compiled kernels, required built) or ``"torch"`` (the fallback paths)."""
    if request.param == "native":
        if os.environ.get(native.DISABLE_ENV) == "0":
            pytest.skip(f"the compiled kernels are disabled ({native.DISABLE_ENV}=0): the torch paths only")
        require("xlaunch.nn's compiled kernels (python -m xlaunch.nn.native)",
                str(native.library_path()) if native.available() else None)
        assert native.ops() is not None
    with native.prefer_native(request.param == "native"):
        yield request.param
