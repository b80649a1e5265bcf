"""Every xlaunch name the docs show imports as shown: each ``import xlaunch...``/``from xlaunch...
import ...`` line of their code blocks runs, and each dotted ``xlaunch.x.y`` they name resolves
(e.g. ``master_params`` is documented under ``xlaunch.kernels``, so it must be there)."""
from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
IMPORT_LINE = re.compile(r"^\s*((?:from xlaunch[\w.]* import [\w, ]+|import xlaunch[\w.]*(?: as \w+)?))\s*(?:#.*)?$", re.M)
DOTTED = re.compile(r"(?<![\w/.-])xlaunch(?:\.\w+)+")


def documented_imports() -> list[tuple[str, str]]:
    return [(page.name, line) for page in PAGES for block in CODE_BLOCK.findall(page.read_text(encoding="utf-8"))
            for line in IMPORT_LINE.findall(block)]


def documented_dotted_names() -> list[tuple[str, str]]:
    found = set()
    for page in PAGES:
        for quoted in re.findall(r"`([^`\n]+)`", page.read_text(encoding="utf-8")):
            found.update((page.name, name) for name in DOTTED.findall(quoted))
    return sorted(found)


def resolve(dotted: str) -> object:
    """The module or attribute ``dotted`` names (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(dotted)


def test_the_docs_show_imports_and_name_xlaunch_objects() -> None:
    assert ("kernels.md", "from xlaunch.kernels import master_params, to_fused") in documented_imports()
    assert len(documented_dotted_names()) > 20


def test_every_documented_import_line_runs() -> None:
    failures = []
    for page, line in documented_imports():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # old module paths warn, and still import
            try:
                exec(line, {})
            except Exception as exc:
                failures.append(f"{page}: {line}: {type(exc).__name__}: {exc}")
    assert not failures


def test_every_documented_dotted_name_resolves() -> None:
    failures = []
    for page, name in documented_dotted_names():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                resolve(name)
            except Exception as exc:
                failures.append(f"{page}: {name}: {type(exc).__name__}: {exc}")
    assert not failures
