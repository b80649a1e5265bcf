"""The ``xlaunch_here`` fixture (``from in_process import xlaunch_here``): ``xlaunch ARGV`` as ``cli.run`` in the test process (what ``python -m xlaunch``
runs, from the repository root, without an inherited ``XLAUNCH_FSROOT``), for the checks that parse,
plan and print or refuse; a plan that went on would start its program from here. The real process's
exit status, its one stderr line and "nothing started" are each file's own subprocess tests."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def xlaunch_here(monkeypatch, capsys):
    from xlaunch.launcher.cli import command as cli

    def run(*argv: str, fsroot: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        with monkeypatch.context() as patch:
            patch.chdir(REPO)
            patch.delenv("XLAUNCH_FSROOT", raising=False)
            for key, value in {**(env or {}), **({"XLAUNCH_FSROOT": fsroot} if fsroot else {})}.items():
                patch.setenv(key, value)
            capsys.readouterr()
            code = cli.run(list(argv))
            out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["xlaunch", *argv], code, out, err)

    return run
