"""xlaunch._torch's import helpers: the collector paused around heavy imports, and its state restored."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

from xlaunch._torch import import_quietly, paused_gc


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_gc_restores_the_state_it_found(gc_enabled) -> None:
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():                 # nested: the inner one leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with paused_gc():
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()             # off before: still off


def test_import_quietly_imports_with_the_collector_paused(gc_enabled, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "xlaunch_probe_heavy.py").write_text("import gc\nENABLED_AT_IMPORT = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "xlaunch_probe_heavy", raising=False)
    import_quietly("xlaunch_probe_heavy", "xlaunch_probe_not_installed")
    assert sys.modules["xlaunch_probe_heavy"].ENABLED_AT_IMPORT is False
    assert gc.isenabled()
