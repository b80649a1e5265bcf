"""xlaunch-tune with ``--kernel-report`` fixed: every trial's launch reports its kernels, and the
table and files get a kernels column. The program replays a recorded oneDNN log (no torch)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.live

LOG = Path(__file__).resolve().parents[1] / "launcher" / "observe" / "onednn_logs" / "avx2_eager_f32.log"
PROGRAM = f"""\
import os, sys
sys.stdout.write(open({str(LOG)!r}).read())
print("score:", 10 + ("KMP_BLOCKTIME" in os.environ))
"""


def test_trials_carry_what_their_kernels_ran(tmp_path: Path, iomp_path: str) -> None:   # omp-runtime intel
    (tmp_path / "program.py").write_text(PROGRAM)
    (tmp_path / "space.toml").write_text('[space]\nomp-runtime = ["default", "intel"]\n')
    done = subprocess.run([sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--metric", r"score: (\d+)",
                           "--final-rounds", "1", "--output-dir", "out", "--no-plot", "--kernel-report", "--ninstances", "1",
                           "--ncores-per-instance", "1", "program.py"],
                          cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 0, done.stderr
    cell = "AVX2, conv avx2 f32, w 1.0/call"
    header = next(line for line in done.stdout.splitlines() if "median" in line)
    assert "kernels" in header and done.stdout.count(cell) >= 2
    doc = json.loads((tmp_path / "out" / "trials.json").read_text())
    assert all(run["kernels"] == [cell] for trial in doc["trials"] for run in trial["runs"])
    assert all(trial["launch_config"]["kernel-report"] is True for trial in doc["trials"])
    rows = list(csv.DictReader((tmp_path / "out" / "trials.csv").open()))
    assert [row["kernels"] for row in rows] == [cell, cell]
    # the metric still comes from the program's own output: oneDNN's lines never reached it
    trial_logs = list((tmp_path / "out").rglob("trial_instance_0.log"))
    assert trial_logs and all(b"onednn_verbose" not in p.read_bytes() for p in trial_logs)
