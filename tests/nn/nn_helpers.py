"""Shared by tests/nn: run a test on the compiled kernels at every ISA level and on the pure-torch paths.

``kernels`` is a fixture parametrized over ``native-<level>`` for each level the library is
compiled at (skipped, with the reason, for a level this CPU cannot execute) and ``torch``; the
compiled ones need the libraries that ``make setup`` builds (skipped locally without them, a
failure under CI, as system libraries are). Each native run first checks that the library it
calls really is that level's (``compiled_isa()``, read from the compiler's macros).
"""
from __future__ import annotations

import os

import pytest
from conftest import require

torch = pytest.importorskip("torch")

from xlaunch.nn import native  # noqa: E402


@pytest.fixture(params=[*(f"native-{level}" for level in native.LEVELS), "torch"])
def kernels(request) -> str:
    """``"native-<level>"`` (that level's compiled kernels, required built) or ``"torch"`` (the fallback paths)."""
    level = request.param.partition("-")[2] or False
    if level:
        if level not in native.runnable_levels():
            pytest.skip(f"this CPU cannot execute the {level} kernels")
        if os.environ.get(native.DISABLE_ENV) == "0":
            pytest.skip(f"the compiled kernels are disabled ({native.DISABLE_ENV}=0): the torch paths only")
        require(f"xlaunch.nn's compiled {level} kernels (python -m xlaunch.nn.native)",
                str(native.library_path(level)) if native.available(level) else None)
        assert native.ops_at(level).compiled_isa() == level
    with native.prefer_native(level):
        yield request.param


@pytest.fixture(params=["native", "torch"])
def dispatch(request) -> str:
    """The kernels at the level this process chose, or the torch paths: for tests of the operators'
    plumbing (tracing, compiling) rather than of the kernels, which ``kernels`` runs at every level."""
    if request.param == "native":
        if os.environ.get(native.DISABLE_ENV) == "0":
            pytest.skip(f"the compiled kernels are disabled ({native.DISABLE_ENV}=0): the torch paths only")
        require("xlaunch.nn's compiled kernels (python -m xlaunch.nn.native)",
                str(native.library_path()) if native.available() else None)
        assert native.ops().compiled_isa() == native.level()
    with native.prefer_native(request.param == "native"):
        yield request.param
