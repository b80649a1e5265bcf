"""Shell completion through the real command (bash and zsh protocols of click)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def complete(words: str, cword: int, shell: str = "bash", cwd=REPO) -> list[str]:
    env = dict(os.environ, COMP_WORDS=words, COMP_CWORD=str(cword), _XLAUNCH_COMPLETE=f"{shell}_complete")
    result = subprocess.run([sys.executable, "-m", "xlaunch"], env=env, capture_output=True, text=True,
                            timeout=60, cwd=cwd)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return result.stdout.splitlines()


def test_option_names_complete_and_hidden_spellings_do_not() -> None:
    assert "plain,--ninstances" in complete("xlaunch --nins", 1)
    assert [c for c in complete("xlaunch --enable-j", 1) if c] == []   # ipexrun spellings work, not offered


def test_choices_complete() -> None:
    assert complete("xlaunch --memory-allocator j", 2) == ["plain,jemalloc"]
    assert set(complete("xlaunch --omp-runtime ", 2)) == {"plain,auto", "plain,default", "plain,intel"}


def test_program_completes_as_a_file(tmp_path) -> None:
    assert complete("xlaunch --ninstances 2 exa", 3) == ["file,exa"]


def test_sourcing_scripts_exist_for_bash_and_zsh() -> None:
    for shell, marker in (("bash", "complete "), ("zsh", "#compdef xlaunch")):
        env = dict(os.environ, _XLAUNCH_COMPLETE=f"{shell}_source")
        result = subprocess.run([sys.executable, "-m", "xlaunch"], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and marker in result.stdout, result.stderr
