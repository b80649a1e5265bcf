"""bench/tune.py: a run's throughput is the aggregate over the window every instance ran in, not the sum
of the instances' own lines; a --best that xlaunch refuses stops the bench before anything starts; a launch
that outlives its --timeout is stopped with everything it started (run_cpu's program is its child)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_modules import BENCH, load
from processes import running, wait_gone

# a launch of two instances, as infer.py --barrier K --timeline-dir DIR writes them: instance 0 runs
# alone for its first second at 200 img/s (batches of 20 every 0.1 s), then both at 100 img/s (every
# 0.2 s) for a second. Each prints its own line, as infer.py does: 150 and 100 img/s.
TWO_INSTANCES = """
import json, os, sys
folder = sys.argv[sys.argv.index("--timeline-dir") + 1]
assert sys.argv[sys.argv.index("--barrier") + 1] == "2"
gap = float(sys.argv[sys.argv.index("--gap") + 1]) if "--gap" in sys.argv else None
first = [0.1 * i for i in range(1, 11)] + [1 + 0.2 * i for i in range(1, 6)]
second = [1 + 0.2 * i for i in range(1, 6)]
if gap is not None:       # the second starts after the first's last batch
    second = [first[-1] + gap + 0.2 * i for i in range(1, 6)]
for index, begin, ends in (("0", 0.0, first), ("1", second[0] - 0.2, second)):
    with open(os.path.join(folder, index + ".json"), "w") as handle:
        json.dump({"batch_size": 20, "begin": 1000 + begin, "ends": [1000 + e for e in ends]}, handle)
print("throughput: 150.0 img/s", flush=True)
print("throughput: 100.0 img/s", flush=True)
"""


def test_a_runs_throughput_counts_only_the_window_every_instance_ran(tmp_path: Path, capsys) -> None:
    """The sum of the lines said 250 img/s; while both ran, they did 200 together."""
    program = tmp_path / "two.py"
    program.write_text(TWO_INSTANCES)
    tune = load("tune")
    assert tune.run_once("best", [sys.executable, str(program)], 2, 30.0) == pytest.approx(200.0)
    assert capsys.readouterr().out == ""


def test_instances_that_never_ran_together_have_no_throughput(tmp_path: Path, capsys) -> None:
    program = tmp_path / "two.py"
    program.write_text(TWO_INSTANCES)
    tune = load("tune")       # instance 1 starts 1 s after instance 0's last batch
    assert tune.run_once("best", [sys.executable, str(program), "--gap", "1"], 2, 30.0) is None
    assert capsys.readouterr().out == "  best: its 2 instances never ran at the same time\n"


def test_a_missing_instance_is_a_failed_run(tmp_path: Path, capsys) -> None:
    program = tmp_path / "one.py"
    program.write_text("print('throughput: 99.0 img/s')\n")
    tune = load("tune")
    assert tune.run_once("best", [sys.executable, str(program)], 2, 30.0) is None
    assert capsys.readouterr().out == "  best: exit 0, 0 of 2 instance(s) measured: throughput: 99.0 img/s\n"


def test_the_barrier_counts_come_from_xlaunchs_plan(tmp_path: Path) -> None:
    tune = load("tune")
    assert tune.planned_instances([]) >= 1
    best = tmp_path / "best.toml"
    best.write_text("ninstances = 1\n")
    assert tune.planned_instances(["--config", str(best)]) == 1


def test_a_best_xlaunch_refuses_is_one_line_and_status_2_before_anything_runs(tmp_path: Path) -> None:
    best = tmp_path / "best.toml"
    best.write_text("ninstances = 0\n")
    done = subprocess.run([sys.executable, str(BENCH / "tune.py"), "--best", str(best), "--reps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines()[-1] == (f"tune.py: error: --best {best}: --ninstances: must be a positive "
                                            f"integer, got 0 in {best}")


PARENT = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
print("throughput: 1.0 img/s", flush=True)
time.sleep(60)
"""


def test_a_launch_past_its_timeout_leaves_nothing_running(tmp_path: Path) -> None:
    """subprocess.run's timeout killed the launcher alone: its program ran on, an orphan."""
    bench = load("tune")
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    value = bench.run_once("slow", [sys.executable, "-c", PARENT, str(pid_file)], instances=1, timeout=1.0)
    assert value is None and time.monotonic() - started < 10
    child = int(pid_file.read_text())
    assert running([child]) == [] or wait_gone([child], 0.5) == [], "the launch's child outlived it"
    # a launch that ends at once without measuring: no figure (the shared window: tests/test_bench_tune.py)
    assert bench.run_once("quick", [sys.executable, "-c", "print('throughput: 2.5 img/s')"], instances=1,
                          timeout=30) is None
