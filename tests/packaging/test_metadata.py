"""The package's metadata as pip reads it (pyproject.toml): every extra installable on each Python it serves."""
from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def test_each_extra_pins_matplotlib_per_python_like_the_tune_extra():
    """matplotlib 3.11.2 has no release for Python 3.10: the bench extra pinned it alone, so `pip install
    ".[torch,bench]"` on 3.10 (torch 2.13's oldest Python) found no matplotlib."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {name: sorted(r for r in requirements if r.split("=")[0].split(";")[0].strip() == "matplotlib")
            for name, requirements in extras.items()}
    assert pins["tune"] and all(";" in pin for pin in pins["tune"]), pins["tune"]
    for name, found in pins.items():
        assert found in ([], pins["tune"]), (name, found)
