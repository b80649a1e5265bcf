"""TPE's study.db on a full disk (or damaged): the search goes on with the study in memory, said
in one warning line; it was SQLAlchemy's traceback before any trial ran (or in the middle of the
session). --resume gives the study on disk what it lacks from trials.json."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from xlaunch.tune.space import Dimension, Space                  # noqa: E402
from xlaunch.tune.strategies import STUDY_NAME, TpeStrategy      # noqa: E402

SPACE = Space((Dimension("ninstances", (1, 2)), Dimension("benchmark", (False, True))), "space.toml")


def test_a_study_db_that_cannot_be_written_leaves_tpe_in_memory(tmp_path: Path) -> None:
    """Files capped below an empty study's size (RLIMIT_FSIZE: the disk full as SQLite meets it)."""
    import resource

    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false, true]\nbind-with = ['native', 'none']\n")
    (tmp_path / "prog.py").write_text("print('score: 5')\n")
    done = subprocess.run(
        [sys.executable, "-m", "xlaunch.tune", "--strategy", "tpe", "--trials", "3", "--seed", "1", "--space",
         "space.toml", "--metric", r"score: (\S+)", "--ninstances", "1", "--final-rounds", "0", "--no-plot",
         "--output-dir", "out", "prog.py"], cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("xlaunch-tune: warning: cannot use out/study.db (") \
        and warnings[0].endswith("TPE goes on with its study in memory; trials.json keeps every trial"), done.stderr
    doc = json.loads((tmp_path / "out" / "trials.json").read_text())
    assert [t["status"] for t in doc["trials"]] == ["ok"] * 3 and doc["best"] is not None


def test_a_study_db_that_fails_mid_session_keeps_every_result(tmp_path: Path, capsys, monkeypatch) -> None:
    from sqlalchemy.exc import OperationalError

    strategy = TpeStrategy(SPACE, goal="max", seed=1, storage=str(tmp_path / "study.db"))
    first = strategy.ask(set())
    strategy.tell(first, 3.0)

    def full(*_: object, **__: object) -> None:
        raise OperationalError("INSERT", {}, Exception("database or disk is full"))

    second = strategy.ask({json.dumps(sorted(first.items()), separators=(",", ":"))})
    monkeypatch.setattr(strategy.study, "tell", full)
    strategy.tell(second, None)                          # the disk filled up: the study moves to memory
    assert "database or disk is full): TPE goes on with its study in memory" in capsys.readouterr().err
    assert strategy.study._storage.__class__.__name__ == "InMemoryStorage"
    held = sorted((t.params["ninstances"], t.params["benchmark"], t.state.name, t.value) for t in strategy.study.trials)
    assert held == sorted([(first["ninstances"], first["benchmark"], "COMPLETE", 3.0),
                           (second["ninstances"], second["benchmark"], "FAIL", None)])
    assert strategy.ask(set()) in list(SPACE.points())  # and the search goes on


def test_resume_gives_the_study_what_it_lacks(tmp_path: Path) -> None:
    """A study.db left behind (its disk full, or a kill between a trial's record and its tell) holds
    fewer trials than trials.json: resumed, TPE learns the missing ones (it learnt none once the
    study had a trial)."""
    storage = str(tmp_path / "study.db")
    study = optuna.create_study(study_name=STUDY_NAME, storage=f"sqlite:///{storage}", direction="maximize")
    study.enqueue_trial({"ninstances": 1, "benchmark": False})
    dists = {d.key: optuna.distributions.CategoricalDistribution(list(d.values)) for d in SPACE.dimensions}
    study.tell(study.ask(dists), 1.0)
    strategy = TpeStrategy(SPACE, goal="max", seed=1, storage=storage, resume=True)
    strategy.learn([({"ninstances": 1, "benchmark": False}, 1.0), ({"ninstances": 2, "benchmark": True}, 9.0),
                    ({"ninstances": 1, "benchmark": True}, None)])
    held = sorted((t.params["ninstances"], t.params["benchmark"], t.state.name) for t in strategy.study.trials)
    assert held == [(1, False, "COMPLETE"), (1, True, "FAIL"), (2, True, "COMPLETE")]


def test_a_ctrl_c_inside_study_ask_leaves_no_trial_running(tmp_path: Path, monkeypatch) -> None:
    """Optuna creates the trial, then samples it: a Ctrl-C (SIGTERM) between the two left a trial
    RUNNING in study.db with no params, although the session ended with 130 and said nothing."""
    strategy = TpeStrategy(SPACE, goal="max", seed=1, storage=str(tmp_path / "study.db"))

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(strategy.study.sampler, "sample_relative", interrupted)
    with pytest.raises(KeyboardInterrupt):
        strategy.ask(set())
    strategy.abandon()
    assert [t.state.name for t in strategy.study.trials] == ["FAIL"]
