"""xlaunch-tune's command line: bad input is one line, exit 2, nothing run and nothing
written; the launcher path stays free of the tuner's libraries."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from host_cpus import without_budget_warning

from xlaunch.tune.cli import run

SYNTHETIC = str(Path(__file__).resolve().parent / "synthetic.py")


@pytest.mark.parametrize("space, args, line", [
    ("[space]\nninstances = []\n", [], "xlaunch-tune: error: --space: space.toml: ninstances is an empty list"),
    ("[space]\nnintances = [1]\n", [], "xlaunch-tune: error: --space: space.toml: unknown launcher option 'nintances' "
                                       "(did you mean 'ninstances'?)"),
    ("[space]\nmembind = ['bind', 'glue']\n", [],
     "xlaunch-tune: error: --space: space.toml: membind = \"glue\": 'glue' is not one of bind, preferred, interleave, none"),
    ("[space]\nninstances = [1]\n", ["--ninstances", "2"],
     "xlaunch-tune: error: --space: space.toml: ninstances is fixed on the command line and also in the space"),
    ("[space]\nninstances = [1]\n", ["--metric", "score: \\d+"],
     "xlaunch-tune: error: --metric: needs exactly one capture group (the number), found 0"),
    ("[space]\nninstances = [1]\n", ["--goal", "max"],
     "xlaunch-tune: error: --goal: without --metric the objective is wall time, which is minimised"),
    ("[space]\nninstances = [1]\n", ["--strategy", "anneal"],
     "xlaunch-tune: error: --strategy: 'anneal' is not one of grid, random, tpe"),
    ("[space]\nninstances = [1]\n", ["--trials", "0"], "xlaunch-tune: error: --trials: must be >= 1, got '0'"),
    ("[space]\nninstances = [1]\n", ["--repeats", "two"], "xlaunch-tune: error: --repeats: expected an integer, got 'two'"),
    ("[space]\nninstances = [1]\n", ["--resume"],
     "xlaunch-tune: error: --resume: needs --output-dir (where the earlier session wrote its results)"),
    ("[space]\nninstances = [1]\n", ["--memory-allocator", "mimalloc"],
     "xlaunch-tune: error: --memory-allocator: 'mimalloc' is not one of auto, default, jemalloc, tcmalloc"),
    ("[space]\nninstances = [1]\n", ["--dry-run"], "xlaunch-tune: error: --dry-run: no such option"),
    ("[space]\nninstances = [1]\n", ["--summary-json", "s.json"],      # was never written, without a word
     "xlaunch-tune: error: --summary-json: xlaunch-tune keeps each run's summary (runs/NNNN-rK/summary.json in "
     "--output-dir); give it to xlaunch when you run best.toml"),
])
def test_bad_input_is_one_line_and_nothing_runs(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch,
                                                space: str, args: list[str], line: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text(space)
    output = [] if "--resume" in args else ["--output-dir", "out"]
    code = run(["--space", "space.toml", *output, *args, SYNTHETIC])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == line + "\n" and captured.out == ""
    assert not (tmp_path / "out").exists()


def test_program_is_checked_by_the_launcher_before_anything_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    assert run(["--space", "space.toml", "--output-dir", "out", "missing.py"]) == 2
    assert capsys.readouterr().err == "xlaunch-tune: error: PROGRAM: no such file 'missing.py'\n"
    assert run(["--space", "space.toml"]) == 2
    assert capsys.readouterr().err.startswith("xlaunch-tune: error: PROGRAM: missing")
    assert run(["--space", "nowhere.toml", SYNTHETIC]) == 2
    assert capsys.readouterr().err.startswith("xlaunch-tune: error: --space: cannot read nowhere.toml")
    assert not (tmp_path / "out").exists()


def test_a_config_files_summary_json_is_said_and_kept_in_best_toml(tmp_path: Path, capsys, monkeypatch) -> None:
    """Every run's --summary-json overrides the file's: it was dropped without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    (tmp_path / "base.toml").write_text('summary_json = "mine.json"\n')
    assert run(["--space", "space.toml", "--config", "base.toml", "--output-dir", "out", "--no-plot",
                SYNTHETIC, "--sleep-single", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("xlaunch-tune: warning: --config: summary-json in base.toml is not written by the trials "
                      "(each keeps runs/NNNN-rK/summary.json in --output-dir); best.toml keeps it") and len(err) == 2
    assert 'summary-json = "mine.json"' in (tmp_path / "out" / "best.toml").read_text()
    assert (tmp_path / "out" / "runs" / "0001-r1" / "summary.json").is_file() and not (tmp_path / "mine.json").exists()


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def test_missing_optuna_is_a_clear_message(tmp_path: Path) -> None:
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    out = tmp_path / "out"
    done = _python(
        "import sys; sys.modules['optuna'] = None\n"        # import optuna -> ImportError
        "from xlaunch.tune.cli import run\n"
        f"sys.exit(run(['--space', {str(tmp_path / 'space.toml')!r}, '--strategy', 'tpe', '--output-dir', {str(out)!r}, "
        f"{SYNTHETIC!r}]))"
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("xlaunch-tune: error: --strategy: --strategy tpe needs Optuna, which is not installed "
                           "(pip install 'xlaunch[tune]')\n")
    assert not out.exists()


def test_launcher_and_tuner_cli_import_none_of_the_heavy_libraries(tmp_path: Path) -> None:
    heavy = "{'optuna', 'rich', 'matplotlib', 'torch', 'sqlalchemy'}"
    done = _python(
        "import sys, io, contextlib\n"
        "from xlaunch.launcher import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = cli.run(['--dry-run', '--json', {SYNTHETIC!r}])\n"
        "assert code == 0, code\n"
        f"assert not {heavy} & set(sys.modules), {heavy} & set(sys.modules)\n"
        "import xlaunch.tune.cli, xlaunch.tune.session, xlaunch.tune.records\n"
        f"assert not {heavy} & set(sys.modules), {heavy} & set(sys.modules)\n"
    )
    assert done.returncode == 0 and without_budget_warning(done.stderr) == "", done.stderr


def test_help_lists_tuning_and_fixed_launcher_options(capsys) -> None:
    assert run(["--help"]) == 0
    text = capsys.readouterr().out
    assert "--space FILE.toml" in text and "--ncores-per-instance" in text
    assert "--dry-run" not in text and "--log-dir" not in text
    assert text.index("Tuning:") < text.index("Launcher options fixed for every trial")


def test_resume_says_when_the_program_changed(tmp_path: Path, capsys, monkeypatch) -> None:
    """The same command line with another program behind it resumed without a word, its ranking
    mixing measurements of two programs; it is one warning line (the trials are kept)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    (tmp_path / "prog.py").write_text("print('score: 1')\n")
    argv = ["--space", "space.toml", "--metric", r"score: (\d+)", "--output-dir", "out", "--no-plot", "prog.py"]
    assert run(argv) == 0
    capsys.readouterr()
    (tmp_path / "prog.py").write_text("print('score: 2')\n")
    assert run(["--resume", *argv]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("xlaunch-tune: warning: --resume: prog.py changed since out/trials.json was written (its sha256 "
                      "differs): the earlier trials measured the program as it was") and len(err) == 2
    assert run(["--resume", *argv]) == 0                 # unchanged since: nothing to say
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_options_the_tuner_sets_in_a_config_file_are_said_unused(tmp_path: Path, capsys, monkeypatch) -> None:
    """A base config's log-dir (or dry-run) was dropped from every trial and from best.toml without a word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    (tmp_path / "base.toml").write_text('log-dir = "mylogs"\ndry-run = true\n')
    assert run(["--space", "space.toml", "--config", "base.toml", "--no-plot", SYNTHETIC, "--sleep-single", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("xlaunch-tune: warning: --config: dry-run, log-dir in base.toml: not used (set by xlaunch-tune "
                      "for every trial, logs in runs/NNNN-rK/ in its temporary folder) and not written to best.toml")
    assert not (tmp_path / "mylogs").exists()
