"""No import cycle among xlaunch's modules, typing imports included.

import-linter's contracts (pyproject.toml, ``lint-imports``) leave ``if TYPE_CHECKING:`` imports
out, so that a type named across layers does not count; a circle of modules is still a circle
(planner and reserve once named each other). This check reads the same import graph (grimp,
import-linter's own) with every import, function-level and typing ones too, and fails on the
first module that can reach itself.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="grimp (import-linter's graph) is not installed")


def cycles(package: str) -> list[tuple[str, ...]]:
    """One chain per direct import ``a -> b`` that closes a circle (``b`` reaches ``a`` back)."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                found.append((importer, *back))
    return found


def test_no_module_of_xlaunch_imports_itself_back() -> None:
    assert cycles("xlaunch") == []


def test_a_typing_only_circle_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: two modules that name each other only for typing are a circle."""
    name = f"circle_{uuid.uuid4().hex}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "planner.py").write_text(f"from {name}.reserve import reserve\nclass Plan: ...\n")
    (package / "reserve.py").write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        f"    from {name}.planner import Plan\ndef reserve(plan: 'Plan') -> None: ...\n")
    (package / "alone.py").write_text(f"import {name}.planner\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = cycles(name)
    assert sorted(found) == [(f"{name}.planner", f"{name}.reserve", f"{name}.planner"),
                             (f"{name}.reserve", f"{name}.planner", f"{name}.reserve")]
