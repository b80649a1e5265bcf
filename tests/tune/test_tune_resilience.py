"""xlaunch-tune when its own files or the user's hands get in the way: a damaged trials.json on
--resume, an output directory that cannot hold a trial's config file, a seed Optuna cannot take,
a second Ctrl-C while a trial is being stopped."""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from xlaunch.tune import records
from xlaunch.tune.cli import run

SYNTHETIC = str(Path(__file__).resolve().parent / "synthetic.py")
SPACE = {"ninstances": [1, 2], "memory-allocator": ["default", "jemalloc"]}


def _document() -> dict[str, Any]:
    """trials.json as a session writes it: #1 ok, #2 failed."""
    def row(number: int, point: dict, status: str, value: Any) -> dict:
        return {"number": number, "config": point, "status": status, "reason": "" if value else "exit 3 (instance 0)",
                "value": value, "low": value, "high": value, "repeats": 1, "wall_time": 0.5, "instances": [0],
                "runs": [{"status": status, "reason": "" if value else "exit 3 (instance 0)", "value": value,
                          "instance_values": [value], "wall_time": 0.5, "directory": "runs/x"}],
                "launch_config": dict(point), "warnings": []}
    return {"xlaunch_tune": records.FORMAT_VERSION, "signature": {"space": SPACE},
            "trials": [row(1, {"ninstances": 1, "memory-allocator": "default"}, "ok", 12.5),
                       row(2, {"ninstances": 2, "memory-allocator": "default"}, "failed", None)],
            "skipped": [{"config": {"ninstances": 2, "memory-allocator": "jemalloc"}, "reason": "no"}]}


def _edit(path: str, value: Any) -> Callable[[dict], None]:
    """Set ``value`` at ``path`` (keys and indices separated by '/'); ``...`` deletes it."""
    def edit(doc: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        for part in parents:
            doc = doc[part]
        if value is ...:
            del doc[last]
        else:
            doc[last] = value
    return edit


DAMAGE = [
    ("trials/0/runs/0/value", ..., "value is None"),
    ("trials/0/runs/0/value", "12.5", "value is '12.5'"),
    ("trials/0/runs/0/wall_time", None, "wall_time is None"),
    ("trials/0/runs", "abc", "runs is not a list"),
    ("trials/0/runs/0/status", "fine", "status is not 'ok' or 'failed'"),
    ("trials/0/runs/0/kernels", [3], "kernels 3 is not a string"),
    ("trials/0/config", {"ninstances": 7, "memory-allocator": "default"}, "is not a point of the space"),
    ("trials/0/config", {"ninstances": True, "memory-allocator": "default"}, "is not a point of the space"),
    ("trials/0/launch_config", {"ninstances": None}, "cannot write NoneType"),
    ("trials/0/instances", "01", "instances is not a list"),
    ("trials/1/number", 1, "two trials have the same number"),
    ("skipped/0/config", {"x": 1}, "is not a point of the space"),
]


@pytest.mark.parametrize("where, value, words", DAMAGE)
def test_a_damaged_trials_json_is_refused_on_resume(tmp_path: Path, where: str, value: Any, words: str) -> None:
    """Each of these went through (a traceback later, or a best.toml off the space) before."""
    good = _document()
    (tmp_path / "trials.json").write_text(json.dumps(good))
    trials, skipped = records.load(str(tmp_path), {"space": SPACE})
    assert [t.value for t in trials] == [12.5, None] and len(skipped) == 1
    damaged = copy.deepcopy(good)
    _edit(where, value)(damaged)
    (tmp_path / "trials.json").write_text(json.dumps(damaged))
    with pytest.raises(records.ResumeError, match="is damaged") as caught:
        records.load(str(tmp_path), {"space": SPACE})
    assert words in str(caught.value)


def _grid_tuner(workdir: Path, space_text: str = "[space]\nninstances = [1]\n") -> Any:
    from xlaunch.tune.candidate import Program
    from xlaunch.tune.objective import Objective
    from xlaunch.tune.session import Tuner
    from xlaunch.tune.space import parse_space
    from xlaunch.tune.strategies import GridStrategy
    from xlaunch.tune.trial import Launch

    space = parse_space(space_text, "space.toml", fixed={})
    return Tuner(space=space, program=Program((SYNTHETIC,)), objective=Objective(None, "sum", "min"),
                 strategy=GridStrategy(space), launch=Launch((SYNTHETIC,)), workdir=str(workdir), trials=5)


@pytest.mark.parametrize("cause", ["fifo", "full disk"])
def test_a_trial_whose_config_file_cannot_be_written_fails_and_the_session_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: str) -> None:
    """Each point's config file is written in the output directory before the launcher checks it: a
    FIFO planted at its path or a full disk was a traceback that ended the session, results unwritten."""
    import errno

    from xlaunch.tune import candidate

    scratch = tmp_path / ".candidate.toml"
    if cause == "fifo":
        os.mkfifo(scratch)
        words = "is a FIFO, not a regular file"
    else:
        def full(path: str, table: Any, header: str = "") -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(candidate.tomlfile, "write", full)
        words = f"cannot write {scratch}: No space left on device"
    outcome = _grid_tuner(tmp_path, "[space]\nninstances = [1, 2]\n").run()
    assert not outcome.interrupted and outcome.best is None and not outcome.skipped
    assert [(r.number, r.point, r.ok) for r in outcome.trials] == [(1, {"ninstances": 1}, False),
                                                                   (2, {"ninstances": 2}, False)]
    assert all(words in r.reason for r in outcome.trials), [r.reason for r in outcome.trials]
    assert not (tmp_path / "runs").exists()                      # nothing was launched
    assert (cause == "fifo") == os.path.lexists(scratch)         # a planted FIFO is not ours to remove


@pytest.mark.parametrize("argv, line", [
    (["--strategy", "tpe", "--seed", str(2**32)], "--seed: must be between 0 and 4294967295, got '4294967296'"),
    (["--timeout", "1e400"], "--timeout: must be a finite number, got '1e400'"),
    (["--timeout", "1e10"], "--timeout: must be between 0.001 and 1000000, got '1e10'"),   # was OverflowError's
])                                                                   # traceback after the first trial ran
def test_numbers_out_of_range_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch, argv: list[str], line: str) -> None:
    """A seed past 2**32 - 1 was numpy's traceback from inside Optuna's TPE; an infinite timeout
    was said to be below 0.001."""
    if "tpe" in argv:
        pytest.importorskip("optuna")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    assert run(["--space", "space.toml", *argv, SYNTHETIC]) == 2
    assert capsys.readouterr().err == f"xlaunch-tune: error: {line}\n"
    assert os.listdir(tmp_path) == ["space.toml"]


@pytest.mark.live
def test_a_second_interrupt_while_a_trial_is_stopped_leaves_nothing_running(tmp_path: Path) -> None:
    """The first SIGTERM (or Ctrl-C) stops the trial: the launcher forwards SIGTERM, which the
    program ignores, and would SIGKILL it after its grace period. A second one made the tuner
    leave at once, its launcher and the instance still running; now the launcher gets it too
    (its second SIGTERM kills every instance now) and the tuner exits after them."""
    import signal
    import subprocess
    import sys
    import time

    from processes import running, wait_gone

    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--grace-period", "30",
                             "--output-dir", "out", "--no-plot", SYNTHETIC, "--hang"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    run_dir = tmp_path / "out" / "runs" / "0001-r1"
    log = run_dir / "trial_instance_0.log"
    deadline = time.monotonic() + 60
    while not (log.is_file() and log.read_text() == "hanging\n"):
        assert proc.poll() is None and time.monotonic() < deadline, "the trial never started"
        time.sleep(0.05)
    launcher_log = (run_dir / "trial_launcher.log").read_text()
    pids = [int(p) for p in re.findall(r"instance 0 started: pid (\d+)", launcher_log)]
    assert pids and running(pids)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert running(pids) == [], "the instance outlived the tuner"
    assert "interrupted: results so far" in out
    assert wait_gone(pids, 1) == []


@pytest.mark.parametrize("planted", ["fifo", "file", "symlink"])
def test_a_run_directory_replaces_whatever_sits_at_runs(tmp_path: Path, planted: str) -> None:
    """A FIFO or a file at DIR/runs failed every trial with 'cannot write DIR/runs/0001-r1: File exists'."""
    from xlaunch.tune.trial import fresh_directory

    runs = tmp_path / "runs"
    victim = tmp_path / "victim"
    victim.mkdir()
    {"fifo": lambda: os.mkfifo(runs), "file": lambda: runs.write_text("x\n"),
     "symlink": lambda: runs.symlink_to(victim)}[planted]()
    fresh_directory(str(runs / "0001-r1"))
    assert runs.is_dir() and not runs.is_symlink() and (runs / "0001-r1").is_dir()
    assert list(victim.iterdir()) == []


def test_an_output_dir_in_use_by_another_session_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sessions in one --output-dir: the second removed the first one's run directories under
    its running trials (each then failed with 'no metric') and the two overwrote each other's
    trials.json. The session holds DIR/.xlaunch-tune.lock; another one is refused before it runs."""
    import fcntl

    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1]\n")
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / ".xlaunch-tune.lock", "w") as held:     # what a running session holds
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert run(["--space", "space.toml", "--output-dir", "out", "--no-plot", SYNTHETIC]) == 2
        assert capsys.readouterr().err == ("xlaunch-tune: error: --output-dir: 'out' is in use by another "
                                           "xlaunch-tune session (pid 4242)\n")
        assert os.listdir(tmp_path / "out") == [".xlaunch-tune.lock"]          # nothing ran, nothing written
    (tmp_path / "out3").mkdir()
    os.symlink(tmp_path / "space.toml", tmp_path / "out3" / ".xlaunch-tune.lock")
    assert run(["--space", "space.toml", "--output-dir", "out3", "--no-plot", SYNTHETIC]) == 2
    assert capsys.readouterr().err.startswith("xlaunch-tune: error: --output-dir: cannot open out3/.xlaunch-tune.lock")
    assert (tmp_path / "space.toml").read_text() == "[space]\nninstances = [1]\n"


def test_a_re_measurement_cut_short_is_not_reported_as_deciding(tmp_path: Path) -> None:
    """Ctrl-C during the final rounds: best.toml said '2 re-measured (median of 1 interleaved round ...)'
    and the table '-> no result', though the search's median chose the winner and nothing failed."""
    from xlaunch.tune.report import rows
    from xlaunch.tune.session import Final, Outcome, TrialRecord

    def record(number: int, value: float) -> TrialRecord:
        run_ = {"status": "ok", "reason": "", "value": value, "instance_values": [value], "wall_time": 0.5}
        return TrialRecord(number, {"ninstances": number}, {"ninstances": number}, (0,), [run_])

    from xlaunch.tune.objective import Objective, compile_metric

    tuner = _grid_tuner(tmp_path, "[space]\nninstances = [1, 2]\n")
    tuner.objective = Objective(compile_metric(r"score: (\d+)"), "sum", "max")
    tuner.records = [record(1, 20.0), record(2, 10.0)]
    tuner.final = Final((1, 2), {1: [19.0], 2: []}, {1: [], 2: []}, None)     # stopped in round 1
    outcome = Outcome(tuner.records, [], tuner.final, tuner.best(), interrupted=True)
    assert outcome.best is not None and outcome.best.number == 1
    records.save_best(str(tmp_path), outcome.best, ["x.py"], "score", outcome.final)
    text = (tmp_path / "best.toml").read_text()
    assert "re-measured" not in text and "20 (median of 1, 20 .. 20), chosen by the search; its re-measurement " \
        "against the runner-up did not finish (19, median of 1 interleaved round, 19 .. 19)" in text
    notes = rows(tuner, outcome)[2]
    assert "re-measured interleaved: #1 19 (n=1) vs #2 - (n=0) -> interrupted before it decided: the search's " \
        "best is kept" in notes and "interrupted: results so far" in notes
    tuner.final = Final((1, 2), {1: [19.0, 21.0], 2: [9.0, 9.5]}, {1: [], 2: []}, 1)      # decided
    records.save_best(str(tmp_path), tuner.best(), ["x.py"], "score", tuner.final)
    assert "score: 20 re-measured (median of 2 interleaved rounds, 19 .. 21); search: 20" in \
        (tmp_path / "best.toml").read_text()


def test_a_finalist_that_fails_a_re_measurement_round_loses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#2 measures 100 against #1's 50 but exits 3 in one final round: it won on the median of the
    rounds it survived, and the line under the table did not mention the failure."""
    from xlaunch.tune import session, trial
    from xlaunch.tune.objective import Objective, compile_metric
    from xlaunch.tune.report import rows
    from xlaunch.tune.session import Outcome

    launches: dict[int, int] = {}

    def fake_run_once(launch, candidate, objective, directory, budget=None):  # noqa: ANN001, ANN202
        second = 2 if candidate.point["benchmark"] else 1   # a dimension every machine plans, 1 CPU too
        launches[second] = launches.get(second, 0) + 1
        if second == 2 and launches[second] == 3:
            return trial.RunResult(False, 0.1, None, (None,), "exit 3 (instance 0)", directory)
        return trial.RunResult(True, 0.1, 50.0 * second, (50.0 * second,), "", directory)

    monkeypatch.setattr(session, "run_once", fake_run_once)
    tuner = _grid_tuner(tmp_path, "[space]\nbenchmark = [false, true]\n")
    tuner.objective = Objective(compile_metric(r"score: (\d+)"), "sum", "max")
    outcome = tuner.run()
    assert outcome.final is not None and outcome.final.numbers == (2, 1)
    assert outcome.final.failures == {2: ["exit 3 (instance 0)"], 1: []}
    assert outcome.final.winner == 1 and outcome.best is not None and outcome.best.number == 1
    notes = rows(tuner, Outcome(tuner.records, [], outcome.final, outcome.best))[2]
    assert "re-measured interleaved: #2 100 (n=2, failed 1x: exit 3 (instance 0)) vs #1 50 (n=3) -> #1 wins" in notes


def test_best_toml_says_how_to_run_it_from_where_the_tuner_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'xlaunch --config best.toml examples/infer.py' ran from neither place: best.toml is in the
    output directory, the program's path is relative to where xlaunch-tune ran."""
    from xlaunch.tune.session import TrialRecord

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tune out").mkdir()
    run_ = {"status": "ok", "reason": "", "value": 3.0, "instance_values": [3.0], "wall_time": 0.5}
    best = TrialRecord(1, {"ninstances": 1}, {"ninstances": 1}, (0,), [run_])
    records.save_best("tune out", best, ["examples/infer.py", "--iterations", "10"], "score")
    assert "# Run it with:  xlaunch --config 'tune out/best.toml' examples/infer.py --iterations 10\n" in \
        (tmp_path / "tune out" / "best.toml").read_text()


# Delivers SIGINT while the named module is imported (a deterministic "Ctrl-C while it starts").
_INTERRUPT_DURING_IMPORT = '''
import importlib.abc, os, signal, sys, time
class _Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == os.environ["XL_INTERRUPT_AT"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        return None
sys.meta_path.insert(0, _Interrupt())
'''


@pytest.mark.parametrize("module", ["shlex", "xlaunch.tune.space"])     # a stdlib module the CLI imports, and ours
def test_a_ctrl_c_while_the_tuner_starts_is_exit_130_without_a_traceback(tmp_path: Path, module: str) -> None:
    """The console script imported the whole CLI before any handler: a Ctrl-C in those imports printed
    a KeyboardInterrupt traceback (4 of 30 random early Ctrl-Cs)."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_INTERRUPT_DURING_IMPORT)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)]), "XL_INTERRUPT_AT": module}
    done = subprocess.run([sys.executable, "-c", "import sys; from xlaunch.tune import main; sys.argv[0] = 'xlaunch-tune'; main()",
                           "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", ""), done


def test_resume_fails_the_trials_a_killed_session_left_running(tmp_path: Path) -> None:
    """A session killed outright (SIGKILL, a crash) cannot mark its trial: the next --resume does,
    under the directory's lock, so TPE and optuna-dashboard never see a trial running for ever."""
    optuna = pytest.importorskip("optuna")
    from xlaunch.tune.space import Dimension, Space
    from xlaunch.tune.strategies import STUDY_NAME, TpeStrategy

    storage = str(tmp_path / "study.db")
    study = optuna.create_study(study_name=STUDY_NAME, storage=f"sqlite:///{storage}", direction="maximize")
    study.ask()                                       # the trial the killed session was measuring
    space = Space((Dimension("ninstances", (1, 2)),), "space.toml")
    strategy = TpeStrategy(space, goal="max", seed=1, storage=storage, resume=True)
    assert [t.state.name for t in strategy.study.trials] == ["FAIL"]
    point = strategy.ask(set())                       # and the search goes on
    strategy.abandon()                                # an interrupted one: FAIL, not RUNNING
    assert point in ({"ninstances": 1}, {"ninstances": 2})
    assert [t.state.name for t in strategy.study.trials] == ["FAIL", "FAIL"]


def test_tpe_hands_an_untried_point_without_listing_the_space() -> None:
    """After repeats in a row TPE is handed an untried point: it was picked from a list of every
    point, so a space of 9 million points (two dimensions of 3,000 values) hung the session."""
    import signal

    pytest.importorskip("optuna")
    from xlaunch.tune.space import Dimension, Space, point_key
    from xlaunch.tune.strategies import REPEATS_BEFORE_NUDGE, TpeStrategy

    huge = Space((Dimension("cores_list", tuple(str(i) for i in range(3000))),
                  Dimension("ninstances", tuple(range(1, 3001)))), "space.toml")
    strategy = TpeStrategy(huge, goal="max", seed=1)
    first = strategy.ask(set())
    strategy.tell(first, 1.0)
    strategy._repeats = REPEATS_BEFORE_NUDGE              # as after three known points in a row
    def too_long(*_: Any) -> None:
        raise TimeoutError("listing the space")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(10)
    try:
        point = strategy.ask({point_key(first)})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert point != first and point["cores-list"] in huge.to_json()["cores-list"]
    # a small space nearly all tried: the one point left; all tried: nothing
    small = Space((Dimension("ninstances", (1, 2, 3)),), "space.toml")
    strategy = TpeStrategy(small, goal="max", seed=1)
    done = {point_key({"ninstances": n}) for n in (1, 3)}
    strategy._repeats = REPEATS_BEFORE_NUDGE
    assert strategy.ask(done) == {"ninstances": 2}
    strategy._repeats = REPEATS_BEFORE_NUDGE
    assert strategy.ask(done | {point_key({"ninstances": 2})}) is None
