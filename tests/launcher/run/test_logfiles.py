"""Log files across runs in one directory: no log under its plain name is older than the run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from host_cpus import need_cores

from xlaunch.launcher.run.logfiles import open_log_files

REPO = Path(__file__).resolve().parents[3]


def _run(log_dir: Path, indices: list[int], total: int, kind: str = "instance") -> list[str]:
    files = open_log_files(str(log_dir), "x", indices, total=total, kind=kind)
    for index, log in files.instances.items():
        log.write(f"run of {len(indices)}, {kind} {index}\n".encode())
    files.close()
    return [Path(p).name for p in files.kept]


def test_logs_of_instances_a_smaller_run_does_not_have_are_set_aside(tmp_path: Path) -> None:
    assert _run(tmp_path, [0, 1, 2], 3) == []
    kept = _run(tmp_path, [0], 1)
    plain = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".log"))
    assert plain == ["x_instance_0.log", "x_launcher.log"]            # no stale x_instance_1/2.log
    assert sorted(name.split(".log.")[0] for name in kept) == ["x_instance_0", "x_instance_1", "x_instance_2",
                                                               "x_launcher"]
    assert (tmp_path / "x_instance_0.log").read_text() == "run of 1, instance 0\n"


def test_instance_idx_runs_of_one_plan_leave_each_others_logs_alone(tmp_path: Path) -> None:
    _run(tmp_path, [0], 2)                     # --instance-idx 0 of a 2-instance plan
    kept = _run(tmp_path, [1], 2)              # --instance-idx 1 of the same plan
    assert not [name for name in kept if "instance_0" in name]
    assert (tmp_path / "x_instance_0.log").read_text() == "run of 1, instance 0\n"


def test_rank_logs_are_named_and_set_aside_the_same_way(tmp_path: Path) -> None:
    _run(tmp_path, [0, 1], 2, kind="rank")
    kept = _run(tmp_path, [0], 1, kind="rank")
    assert "x_rank_1.log" not in {p.name for p in tmp_path.iterdir()}
    assert any(name.startswith("x_rank_1.log.") for name in kept)


def test_cli_two_instances_then_one(tmp_path: Path) -> None:
    need_cores(2)
    logs = tmp_path / "logs"
    for count in ("2", "1"):
        done = subprocess.run([sys.executable, "-m", "xlaunch", "--ninstances", count, "--log-dir", str(logs),
                               "--no-python", "echo", count], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert not (logs / "xlaunch_instance_1.log").exists()
    assert (logs / "xlaunch_instance_0.log").read_text() == "1\n"
    assert "earlier logs kept as" in done.stderr


RACE = r"""
import multiprocessing, os, sys
from xlaunch.launcher.errors import OptionError
from xlaunch.launcher.run.logfiles import open_log_files

def run(log_dir, tag, barrier, rounds, errors):
    for n in range(rounds):
        barrier.wait()                      # both runs open their logs at the same moment
        try:
            files = open_log_files(log_dir, "x", [0], total=1)
        except OptionError as error:
            errors.put(str(error))
            continue
        files.instances[0].write(f"{tag}{n}\n".encode())
        files.close()

log_dir, rounds = sys.argv[1], int(sys.argv[2])
context = multiprocessing.get_context("fork")
barrier, errors = context.Barrier(2), context.Queue()
runs = [context.Process(target=run, args=(log_dir, tag, barrier, rounds, errors)) for tag in "ab"]
for p in runs:
    p.start()
for p in runs:
    p.join()
    assert p.exitcode == 0
failed = []
while not errors.empty():
    failed.append(errors.get())
print(len(failed), failed[:1])
"""


def test_two_runs_opening_logs_in_one_directory_at_once_both_start_and_lose_no_log(tmp_path: Path) -> None:
    """Runs sharing a --log-dir set each other's logs aside: neither is refused because the other moved or
    created a log between two steps (exit 2 before), and no earlier log is renamed over (one was lost)."""
    need_cores(2)      # with one CPU the two runs seldom meet between two steps: nothing to find
    rounds = 100
    done = subprocess.run([sys.executable, "-c", RACE, str(tmp_path), str(rounds)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.split()[0] == "0", done.stdout              # every run opened its logs
    logs = [p.read_text() for p in tmp_path.iterdir() if p.name.startswith("x_instance_0.log")]
    assert sorted(logs) == sorted(f"{tag}{n}\n" for tag in "ab" for n in range(rounds))   # each run's log kept
