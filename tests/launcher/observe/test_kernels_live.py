"""--kernel-report on this machine: a tiny eager convolution under ``xlaunch``, with torch's own
oneDNN printing its real lines."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from xlaunch.launcher.observe.kernel_report import RELAYOUT_ADVICE

if importlib.util.find_spec("torch") is None:     # the program imports it; this process need not
    pytest.skip("torch is not installed", allow_module_level=True)

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]

PROGRAM = """\
import torch
conv = torch.nn.Conv2d(3, 8, 3).eval()
print("before", flush=True)
with torch.no_grad():
    for _ in range(4):
        conv(torch.randn(2, 3, 16, 16))   # batch 1 of this size bypasses oneDNN
print("after")
"""


def test_eager_convolution_report_and_clean_output(tmp_path: Path) -> None:
    program = tmp_path / "conv.py"
    program.write_text(PROGRAM)
    summary, logs = tmp_path / "summary.json", tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "xlaunch", "--kernel-report", "--ninstances", "1",
                           "--log-dir", str(logs), "--summary-json", str(summary), str(program)],
                          cwd=tmp_path, capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    # the program's output, and nothing of oneDNN's, on the console and in the instance log
    assert proc.stdout == b"[0] before\n[0] after\n"
    assert (logs / "xlaunch_instance_0.log").read_bytes() == b"before\nafter\n"
    raw = (logs / "xlaunch_instance_0_onednn.log").read_text().splitlines()
    assert raw and all(line.startswith("onednn_verbose,") for line in raw)
    assert any(",create:cache_miss,cpu,convolution," in line for line in raw)

    line = next(line for line in err.splitlines() if line.startswith("xlaunch: instance 0 kernels: "))
    kernels = json.loads(summary.read_text())["instances"][0]["observed"]["kernels"]
    assert kernels["isa"] and kernels["onednn_version"].startswith("v3.")
    conv = kernels["primitives"]["convolution"]
    assert conv["creations"] == 4 and conv["data_types"] == ["f32"], kernels
    assert kernels["lines"] == len(raw) and kernels["exec_lines"] == 0     # creation-level lines only
    top = max(conv["implementations"], key=conv["implementations"].get)
    assert f"convolution: {top} 4 (f32)" in line
    # eager convolutions lay their weights out again on every call (what optimize() removes)
    assert conv["weight_reorders"] == 4 and kernels["weight_reorders_per_call"] == 1.0
    assert "xlaunch: warning: instance 0: weights re-laid-out on every call (convolution: 4 weight reorders in " \
           f"4 calls): {RELAYOUT_ADVICE}" in err
