"""scripts/rewrite_tests.py (make test runs it first): pytest's own cache of rewritten test modules,
byte for byte, and read by pytest where bytecode writing is off."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAILING = "def test_sum():\n    x = 1\n    assert x + 1 == 3\n"


def pytest_run(folder: Path, *args: str, write: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"        # only pytest itself: the installed plugins take seconds
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), "-c", os.devnull, *args, "tests"],
                          capture_output=True, text=True, cwd=folder, env=env, timeout=120)


def test_the_cache_is_pytests_own_and_read_without_writing(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "inner").mkdir(parents=True)
    (tests / "test_top.py").write_text(FAILING)
    (tests / "inner" / "test_inner.py").write_text(FAILING.replace("3", "4"))
    (tests / "helper.py").write_text("VALUE = 1\n")                 # not a test module: left alone
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "rewrite_tests.py"), "tests"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "2 of 2 test modules" in done.stderr, done.stderr
    ours = {p.relative_to(tests): p.read_bytes() for p in tests.rglob("*-pytest-*.pyc")}
    assert sorted(str(p.parent.parent / p.name.split(".")[0]) for p in ours) == ["inner/test_inner", "test_top"]

    debug = tmp_path / "debug.log"
    failed = pytest_run(tmp_path, f"--debug={debug}", write=False)
    assert failed.returncode == 1 and "assert (1 + 1) == 3" in failed.stdout, failed.stdout   # rewritten asserts
    found = [line for line in debug.read_text().splitlines() if "found cached rewritten pyc" in line and str(tests) in line]
    assert len(found) == 2, found

    for path in tests.rglob("*-pytest-*.pyc"):
        path.unlink()
    pytest_run(tmp_path, write=True)                                 # pytest writes its own cache
    assert {p.relative_to(tests): p.read_bytes() for p in tests.rglob("*-pytest-*.pyc")} == ours
