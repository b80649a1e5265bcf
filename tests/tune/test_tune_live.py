"""xlaunch-tune end to end: real launches of a program whose metric depends on the
configuration in a known way (tests/tune/synthetic.py). Needs 2 usable CPUs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SYNTHETIC = str(HERE / "synthetic.py")
REPO = HERE.parent.parent
SPACE = '[space]\nninstances = [1, 2]\nncores-per-instance = [1, 2]\nomp-runtime = ["default", "intel"]\n'
METRIC = r"score: (\d+)"
BEST = {"ninstances": 2, "ncores-per-instance": 1, "omp-runtime": "intel"}

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs"),
]


def tune(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlaunch.tune", *args], cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def only_start_line(stderr: str) -> None:
    """The tuner's stderr off a terminal: its one start line, nothing else (no warning, no traceback)."""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("xlaunch-tune: "), stderr


def load(out: Path) -> dict:
    return json.loads((out / "trials.json").read_text())


def check_known_best(doc: dict) -> None:
    trials = {json.dumps(t["config"], sort_keys=True): t for t in doc["trials"]}
    assert len(trials) == len(doc["trials"]) == 6            # every valid point once, none twice
    best = next(t for t in doc["trials"] if t["number"] == doc["best"])
    assert best["config"] == BEST and best["value"] == 30 and best["runs"][0]["instance_values"] == [15, 15]
    failed = {t["config"]["ncores-per-instance"]: t["reason"] for t in doc["trials"] if t["status"] == "failed"}
    assert failed == {1: "exit 3 (instance 0)", 2: "no metric from instance 0"}
    assert all(t["config"]["omp-runtime"] == "default" and t["config"]["ninstances"] == 1
               for t in doc["trials"] if t["status"] == "failed")
    assert len(doc["skipped"]) == 2 and all("only 2 available" in s["reason"] for s in doc["skipped"])
    final = doc["final"]
    assert final["winner"] == doc["best"] and [c["median"] for c in final["candidates"]] == [30, 25]


def test_grid_finds_the_known_best_and_writes_its_files(tmp_path: Path, iomp_path: str) -> None:
    (tmp_path / "space.toml").write_text(SPACE)
    done = tune(tmp_path, "--space", "space.toml", "--metric", METRIC, "--final-rounds", "1",
                "--output-dir", "out", SYNTHETIC)
    assert done.returncode == 0, done.stderr
    only_start_line(done.stderr)
    check_known_best(load(tmp_path / "out"))
    assert "best" in done.stdout and "failed: exit 3 (instance 0)" in done.stdout
    assert "runner-up" in done.stdout and "lost the re-measurement" not in done.stdout
    assert "30 re-measured (median of 1 interleaved round, 30 .. 30); search: 30" in \
        (tmp_path / "out" / "best.toml").read_text()
    csv_lines = (tmp_path / "out" / "trials.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 6 + 2 and csv_lines[0].startswith("number,ninstances,ncores-per-instance,omp-runtime")
    assert (tmp_path / "out" / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # best.toml is a launcher config file that runs as is
    rerun = subprocess.run([sys.executable, "-m", "xlaunch", "--config", "out/best.toml", SYNTHETIC],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(line for line in rerun.stdout.splitlines() if "score: 15" in line) == [
        "[0] score: 15", "[1] score: 15"]


@pytest.mark.parametrize("strategy", ["random", "tpe"])
def test_sampling_strategies_find_the_known_best(tmp_path: Path, strategy: str, iomp_path: str) -> None:
    (tmp_path / "space.toml").write_text(SPACE)
    done = tune(tmp_path, "--space", "space.toml", "--metric", METRIC, "--strategy", strategy, "--trials", "6",
                "--seed", "3", "--final-rounds", "1", "--json", SYNTHETIC)
    assert done.returncode == 0, done.stderr
    only_start_line(done.stderr)
    check_known_best(json.loads(done.stdout))


def test_resume_continues_without_rerunning(tmp_path: Path, iomp_path: str) -> None:
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    common = ["--space", "space.toml", "--metric", METRIC, "--final-rounds", "0", "--omp-runtime", "intel",
              "--output-dir", "grid", "--no-plot"]       # the grid test checks tune.png
    first = tune(tmp_path, *common, "--trials", "1", SYNTHETIC)
    assert first.returncode == 0, first.stderr
    assert [t["config"] for t in load(tmp_path / "grid")["trials"]] == [{"ninstances": 1}]
    again = tune(tmp_path, *common, SYNTHETIC)
    assert again.returncode == 2 and "exists (add --resume" in again.stderr
    other = tune(tmp_path, *common[:3], r"score=(\d+)", *common[4:], "--resume", SYNTHETIC)
    assert other.returncode == 2 and "different session (metric differs" in other.stderr
    resumed = tune(tmp_path, *common, "--resume", SYNTHETIC)
    assert resumed.returncode == 0 and "resuming after 1" in resumed.stderr
    doc = load(tmp_path / "grid")
    assert [t["config"] for t in doc["trials"]] == [{"ninstances": 1}, {"ninstances": 2}]
    assert sorted(os.listdir(tmp_path / "grid" / "runs")) == ["0001-r1", "0002-r1"]   # #1 not run again
    assert not (tmp_path / "grid" / "tune.png").exists()                                # --no-plot
    assert doc["best"] == 2

    # TPE resumes its Optuna study from the SQLite file
    (tmp_path / "space8.toml").write_text(SPACE)
    common = ["--space", "space8.toml", "--metric", METRIC, "--final-rounds", "0", "--strategy", "tpe",
              "--seed", "1", "--output-dir", "tpe", "--no-plot"]
    first = tune(tmp_path, *common, "--trials", "2", SYNTHETIC)
    assert first.returncode in (0, 1), first.stderr
    import optuna

    storage = f"sqlite:///{tmp_path / 'tpe' / 'study.db'}"
    before = len(optuna.load_study(study_name="xlaunch-tune", storage=storage).trials)
    resumed = tune(tmp_path, *common, "--trials", "3", "--resume", SYNTHETIC)
    assert resumed.returncode in (0, 1), resumed.stderr
    doc = load(tmp_path / "tpe")
    assert [t["number"] for t in doc["trials"]] == [1, 2, 3]
    assert len({json.dumps(t["config"], sort_keys=True) for t in doc["trials"]}) == 3
    assert len(os.listdir(tmp_path / "tpe" / "runs")) == 3       # the first two were not run again
    study = optuna.load_study(study_name="xlaunch-tune", storage=storage)
    assert len(study.trials) > before
    assert {t.value for t in study.trials if t.state.name == "COMPLETE"} <= {15.0, 20.0, 25.0, 30.0}


def _processes_with(token: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if token.encode() in handle.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_hanging_trial_is_killed_at_the_timeout(tmp_path: Path) -> None:
    (tmp_path / "space.toml").write_text("[space]\nninstances = [2]\n")
    token = f"xlaunch-tune-hang-{os.getpid()}"
    done = tune(tmp_path, "--space", "space.toml", "--metric", METRIC, "--timeout", "1.5", "--grace-period", "0.5",
                "--output-dir", "out", "--no-plot", SYNTHETIC, "--hang", token)
    assert done.returncode == 1, done.stderr             # nothing succeeded
    doc = load(tmp_path / "out")
    assert [(t["status"], t["reason"]) for t in doc["trials"]] == [("failed", "timeout after 1.5s")]
    assert doc["best"] is None and not (tmp_path / "out" / "best.toml").exists()
    assert _processes_with(token) == []
    assert "no configuration succeeded" in done.stdout
    logs = sorted(p.name for p in (tmp_path / "out" / "runs" / "0001-r1").iterdir())
    assert "trial_instance_0.log" in logs and "trial_instance_1.log" in logs
    assert (tmp_path / "out" / "runs" / "0001-r1" / "trial_instance_1.log").read_text() == "hanging\n"


def test_without_metric_wall_time_is_minimised(tmp_path: Path) -> None:
    """One instance sleeps 1.5 s more than two: two must win, by more than the second process's start
    (0.6 s was too close: with three test workers on the 2-vCPU VM, two instances' start-up took longer)."""
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    done = tune(tmp_path, "--space", "space.toml", "--repeats", "2", "--final-rounds", "1", "--json",
                SYNTHETIC, "--sleep-single", "1.5")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["objective"]["goal"] == "min" and doc["objective"]["label"] == "wall time (s)"
    best = next(t for t in doc["trials"] if t["number"] == doc["best"])
    assert best["config"] == {"ninstances": 2}
    slow = next(t for t in doc["trials"] if t["config"] == {"ninstances": 1})
    assert slow["value"] >= 1.5 and best["value"] < slow["value"] - 0.3
    assert best["repeats"] == 2 and best["low"] <= best["value"] <= best["high"]


def test_sigterm_ends_the_session_with_nothing_left_running(tmp_path: Path) -> None:
    import signal
    import time

    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    token = f"xlaunch-tune-term-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--metric", METRIC,
                             "--grace-period", "0.5", "--output-dir", "out", SYNTHETIC, "--hang", token],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    log = tmp_path / "out" / "runs" / "0001-r1" / "trial_instance_0.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and log.read_text() == "hanging\n"):
        time.sleep(0.1)
    assert _processes_with(token), "the trial never started"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    only_start_line(err)
    assert "interrupted: results so far" in out
    doc = load(tmp_path / "out")
    # the interrupted trial is not recorded (a --resume runs it again); its logs stay
    assert doc["interrupted"] is True and doc["trials"] == []
    assert log.read_text() == "hanging\n"
    assert _processes_with(token) == []


def test_a_tpe_trial_stopped_by_ctrl_c_is_failed_in_the_study(tmp_path: Path) -> None:
    """Ctrl-C during a TPE trial left it RUNNING in study.db for ever (--resume and
    optuna-dashboard saw a trial still running); it is FAIL, as Optuna's own optimize marks it."""
    import signal
    import time

    optuna = pytest.importorskip("optuna")
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--strategy", "tpe",
                             "--metric", METRIC, "--grace-period", "0.5", "--output-dir", "out", "--no-plot",
                             SYNTHETIC, "--hang"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    log = tmp_path / "out" / "runs" / "0001-r1" / "trial_instance_0.log"
    deadline = time.monotonic() + 60
    while not (log.is_file() and log.read_text() == "hanging\n"):
        assert proc.poll() is None and time.monotonic() < deadline, "the trial never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    only_start_line(err)
    study = optuna.load_study(study_name="xlaunch-tune", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL"]
    assert load(tmp_path / "out")["trials"] == []          # not recorded: --resume runs it again


def test_ranks_of_the_torchrun_front_are_measured(tmp_path: Path) -> None:
    """``--nproc-per-node``, fixed or a dimension: the launcher's per-rank logs are trial_rank_<i>.log,
    and every trial failed with 'no output from instance 0' (the tuner read trial_instance_<i>.log)."""
    pytest.importorskip("torch")
    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false]\n")
    (tmp_path / "prog.py").write_text("import os\nprint('score:', 10 + int(os.environ['LOCAL_RANK']))\n")
    done = tune(tmp_path, "--space", "space.toml", "--metric", METRIC, "--nproc-per-node", "1", "--no-plot",
                "--output-dir", "out", "prog.py")
    assert done.returncode == 0, done.stdout + done.stderr
    trial = load(tmp_path / "out")["trials"][0]
    assert (trial["status"], trial["value"]) == ("ok", 10), trial
    assert "nproc-per-node = 1" in (tmp_path / "out" / "best.toml").read_text()
