"""xlaunch-tune against hostile files and confusing output (issue 23): failures attributed to the
instance that failed first, metric matching time-bounded, nothing written through a planted
symlink, a read-only output directory or a FIFO refused in one line, a table that fits 80
columns with the re-measured winner first, and "nothing ran" when every point was skipped."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xlaunch.tune.candidate import Program
from xlaunch.tune.cli import run
from xlaunch.tune.objective import Objective, compile_metric
from xlaunch.tune.records import save_best
from xlaunch.tune.report import print_table
from xlaunch.tune.session import Final, Outcome, TrialRecord, Tuner
from xlaunch.tune.space import parse_space
from xlaunch.tune.strategies import GridStrategy
from xlaunch.tune.trial import Launch

SYNTHETIC = str(Path(__file__).resolve().parent / "synthetic.py")
# one instance: a long line that (a+)+$ backtracks on for ever; two: instance 1 exits 3 while
# instance 0 waits, so the launcher stops instance 0 (SIGTERM) after instance 1 failed
HOSTILE = """\
import os, sys, time
if os.environ["XLAUNCH_NINSTANCES"] == "1":
    print("a" * 40 + "!")
elif os.environ["XLAUNCH_INSTANCE_INDEX"] == "1":
    time.sleep(0.2)
    sys.exit(3)
else:
    time.sleep(30)
"""


def tune(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlaunch.tune", *args], cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


@pytest.mark.live
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_failures_are_attributed_bounded_and_never_written_through_symlinks(tmp_path: Path) -> None:
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    (tmp_path / "hostile.py").write_text(HOSTILE)
    out = tmp_path / "out"
    (out / "runs" / "0001-r1").mkdir(parents=True)
    victims = {name: tmp_path / f"victim-{name.replace('/', '-')}" for name in
               ("trials.csv", "tune.png", "runs/0001-r1/console.log", "runs/0001-r1/trial.toml")}
    for name, victim in victims.items():
        victim.write_text("precious\n")
        os.symlink(victim, out / name)
    done = tune(tmp_path, "--space", "space.toml", "--metric", "(a+)+$", "--timeout", "2", "--output-dir", "out",
                "hostile.py")
    assert done.returncode == 1, done.stderr            # nothing succeeded
    reasons = [t["reason"] for t in json.loads((out / "trials.json").read_text())["trials"]]
    assert reasons[0].startswith("matching the metric took over 2s") and reasons[0].endswith("from instance 0")
    assert reasons[1] == "exit 3 (instance 1)"          # not instance 0, which the launcher stopped
    assert "#2 failed: exit 3 (instance 1)" in done.stdout and "no configuration succeeded" in done.stdout
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert "a" * 40 in (out / "runs" / "0001-r1" / "trial_instance_0.log").read_text()


def test_fifos_are_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "space.toml")
    done = tune(tmp_path, "--space", "space.toml", SYNTHETIC)
    assert (done.returncode, done.stderr) == (2, "xlaunch-tune: error: --space: space.toml is a FIFO, not a "
                                                 "regular file\n")
    (tmp_path / "ok.toml").write_text("[space]\nninstances = [1]\n")
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / "trials.json")
    done = tune(tmp_path, "--space", "ok.toml", "--output-dir", "out", "--resume", SYNTHETIC)
    assert done.returncode == 2 and done.stderr.startswith("xlaunch-tune: error: --resume: ") \
        and "FIFO" in done.stderr and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("space, words", [("/dev/zero", "a character device, not a regular file"),
                                          ("deep.toml", "nested 33 deep")])
def test_unusable_space_files_are_one_line(tmp_path: Path, capsys, monkeypatch, space: str, words: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deep.toml").write_text("[space]\nninstances = " + "[" * 5000 + "\n")
    assert run(["--space", space, SYNTHETIC]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlaunch-tune: error: --space: ") and words in err and err.count("\n") == 1


def test_a_read_only_output_dir_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
        pytest.skip("/sys is not a read-only file system here")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    assert run(["--space", "space.toml", "--output-dir", "/sys", SYNTHETIC]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xlaunch-tune: error: --output-dir: cannot write in '/sys': ") and err.count("\n") == 1


@pytest.mark.parametrize("argv, words", [(["--trials", "1_0"], "--trials: expected an integer, got '1_0'"),
                                         (["--timeout", "\uff13"], "--timeout: expected a number, got '\uff13'")])
def test_numbers_python_would_take_are_refused(tmp_path: Path, capsys, monkeypatch, argv, words) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    assert run(["--space", "space.toml", *argv, SYNTHETIC]) == 2
    assert capsys.readouterr().err == f"xlaunch-tune: error: {words}\n"


def test_every_point_skipped_says_nothing_ran(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    too_many = len(os.sched_getaffinity(0)) + 1
    (tmp_path / "space.toml").write_text(f"[space]\nninstances = [{too_many}, {too_many + 1}]\n")
    assert run(["--space", "space.toml", SYNTHETIC]) == 1
    out = capsys.readouterr().out
    assert "nothing ran: all 2 point(s) of the space were skipped" in out
    assert "no configuration succeeded" not in out and "rank" not in out        # no empty table


def _tuner(tmp_path: Path) -> tuple[Tuner, Outcome]:
    """A real session's records: six trials over four dimensions, #1 best by its search median,
    #2 the winner of the interleaved re-measurement, #6 failed."""
    space = parse_space('[space]\nninstances = [1, 2]\nncores-per-instance = [1, 2]\n'
                        'memory-allocator = ["jemalloc", "default"]\nomp-runtime = ["default", "intel"]\n',
                        "space.toml", fixed={})
    points = list(space.points())
    records = []
    for number, (point, value) in enumerate(zip(points, [30.0, 29.0, 25.0, 20.0, 15.0, None]), 1):
        run_ = {"status": "ok" if value else "failed", "reason": "" if value else "exit 3 (instance 1)",
                "value": value, "instance_values": [value], "wall_time": 1.5, "directory": ""}
        records.append(TrialRecord(number, point, {}, (0,), [run_]))
    objective = Objective(compile_metric(r"score: (\d+)"), "sum", "max")
    tuner = Tuner(space=space, program=Program(("x.py",)), objective=objective, strategy=GridStrategy(space),
                  launch=Launch(("x.py",)), workdir=str(tmp_path), trials=6, previous=records)
    tuner.final = Final((1, 2), {1: [28.0, 27.5, 28.5], 2: [31.0, 30.5, 31.5]}, {1: [], 2: []}, 2)
    return tuner, Outcome(tuner.records, [], tuner.final, tuner.best())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_table_fits_80_columns_with_the_re_measured_winner_first(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "80")
    tuner, outcome = _tuner(tmp_path)
    screen = _Terminal()
    print_table(tuner, outcome, screen)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", screen.getvalue()).splitlines()      # colours off
    table = [line for line in lines if line.strip() and not line.startswith(("objective", "#", "re-measured", "best"))]
    below = next(i for i, line in enumerate(lines) if line.startswith("objective"))
    assert all(len(line) <= 80 for line in lines[:below]), lines           # the notes under it may be longer
    rows = [line.split() for line in table if line.split()[0] in "123456-"]
    assert rows[0][:2] == ["1", "2"] and rows[0][-1] == "best"            # rank 1 is trial #2, the winner
    assert rows[1][:2] == ["2", "1"] and rows[1][-1] == "runner-up"
    assert all("jemalloc" in row or "default" in row for row in rows)       # never folded ("jemallo/c")
    assert rows[-1][-1] == "failed" and "#6 failed: exit 3 (instance 1)" in lines
    assert not any("lost the re-measurement" in line for line in lines)


def test_best_toml_gives_the_re_measured_value_and_replaces_a_planted_symlink(tmp_path: Path) -> None:
    tuner, outcome = _tuner(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "best.toml")
    save_best(str(tmp_path), outcome.best, ["x.py"], tuner.objective.label, outcome.final)
    text = (tmp_path / "best.toml").read_text()
    assert "31 re-measured (median of 3 interleaved rounds, 30.5 .. 31.5); search: 29 (median of 1" in text
    assert victim.read_text() == "precious\n" and not (tmp_path / "best.toml").is_symlink()


def test_metric_time_limit_counts_per_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pattern that backtracks costs a trial its limit once: the runs of a trial share it."""
    from xlaunch.tune import session, trial
    from xlaunch.tune.candidate import Candidate

    log = tmp_path / "trial_instance_0.log"
    log.write_text("a" * 40 + "!\n")
    objective = Objective(compile_metric("(a+)+$"))
    budget = trial.MatchBudget(0.5)
    first = trial.read_metric(objective, [str(log)], budget)
    assert first[0] == "matching the metric took over 0.5s (a pattern that backtracks, such as (a+)+$, on a long line?)"
    assert budget.left == 0.0
    second = trial.read_metric(objective, [str(log)], budget)       # no child started: nothing left
    assert second == ["matching the metric took this trial's 0.5s in earlier runs"]

    seen: list[object] = []

    def fake_run_once(launch, candidate, objective, directory, budget=None):  # noqa: ANN001, ANN202
        seen.append(budget)
        return trial.RunResult(True, 0.1, 1.0, (1.0,), "", directory)

    monkeypatch.setattr(session, "run_once", fake_run_once)
    space = parse_space("[space]\nninstances = [1]\n", "space.toml", fixed={})
    tuner = Tuner(space=space, program=Program(("x.py",)), objective=objective, strategy=GridStrategy(space),
                  launch=Launch(("x.py",), timeout=3.0), workdir=str(tmp_path), trials=1, repeats=3)
    tuner.measure(Candidate({"ninstances": 1}, {"ninstances": 1}, (0,)), 1)
    tuner.measure(Candidate({"ninstances": 1}, {"ninstances": 1}, (0,)), 2)
    assert len(seen) == 6 and seen[0] is seen[1] is seen[2] and seen[3] is not seen[0]
    assert seen[0].total == 3.0                                          # the limit: --timeout, per trial


def test_huge_metrics_keep_the_table_narrow() -> None:
    """A metric of 1e20 was a 21-digit cell (every digit of ``.0f``); 1e308 a 309-digit one."""
    from xlaunch.tune.report import _fmt

    assert [_fmt(v) for v in (0.5, 1234.4, 987654321.0, 1e20, -1.5e308)] == ["0.5", "1234", "987654321", "1e+20",
                                                                             "-1.5e+308"]


def test_a_metric_lost_to_a_full_disk_says_so(tmp_path: Path) -> None:
    """Files capped at 8000 bytes (RLIMIT_FSIZE: a full disk as the launcher meets it, EFBIG): the
    instance's log loses its last lines, metric included. The reason was 'no metric from instance 0',
    as if the configuration printed none; it says the log was cut short, and why."""
    import errno
    import resource

    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false, true]\n")
    (tmp_path / "chatty.py").write_text("for _ in range(100):\n    print('x' * 99)\nprint('score: 5')\n")
    done = subprocess.run(
        [sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--metric", r"score: (\S+)", "--ninstances", "1",
         "--final-rounds", "0", "--no-plot", "--output-dir", "out", "chatty.py"], cwd=tmp_path, capture_output=True,
        text=True, stdin=subprocess.DEVNULL, timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000)))
    assert done.returncode == 1, done.stderr
    reasons = [t["reason"] for t in json.loads((tmp_path / "out" / "trials.json").read_text())["trials"]]
    assert reasons == [f"no metric from instance 0 (its log is cut short: {os.strerror(errno.EFBIG)})"] * 2, reasons


def test_the_launchers_plan_warnings_are_in_the_report(tmp_path: Path, capsys, monkeypatch) -> None:
    """What the launcher said of a point's plan (e.g. "kept the allocator in your LD_PRELOAD; not adding
    tcmalloc": that trial ran another allocator than its row says) was only in trials.json."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nshare-imports = ['json']\n")
    (tmp_path / "prog.py").write_text("print('score: 1')\n")
    assert run(["--space", "space.toml", "--metric", r"score: (\S+)", "--ninstances", "1", "--no-plot", "prog.py"]) == 0
    out = capsys.readouterr().out
    assert "#1 ran with the launcher's warning: --share-imports with one instance shares nothing" in out, out
