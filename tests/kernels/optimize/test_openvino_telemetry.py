"""xlaunch's OpenVINO and NNCF calls send no usage telemetry, and leave a user's own calls alone.

OpenVINO sends an event at ``import openvino`` and several in every ``convert_model``, NNCF in
``nncf.quantize``: each forks the process (``multiprocessing``, to post to Google Analytics) and
writes a client ID under ``~/intel``. Both skip it under a CI variable and NNCF under pytest, so the
checks run in fresh processes without them, with a private HOME, the forks counted by
``os.register_at_fork`` once the senders' queues are empty, and the forked child's post replaced by
nothing (no network is tried).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch,
              pytest.mark.skipif(importlib.util.find_spec("openvino") is None or importlib.util.find_spec("nncf") is None
                                 or importlib.util.find_spec("openvino_telemetry") is None,
                                 reason="openvino, nncf or openvino-telemetry is not installed")]

REPO = Path(__file__).resolve().parents[3]
# Variables under which OpenVINO's or NNCF's telemetry turns itself off.
QUIETING = ("CI", "TF_BUILD", "JENKINS_URL", "NNCF_CI", "NNCF_DEV")

PROGRAM = r"""
import json, os, sys
forks = [0]
os.register_at_fork(before=lambda: forks.__setitem__(0, forks[0] + 1))
import time
from openvino_telemetry.backend import backend_ga4
from openvino_telemetry.utils import sender as telemetry_sender
backend_ga4._send_func = lambda request: None      # the forked child posts nothing
senders, made = [], telemetry_sender.TelemetrySender.__init__
def keep(self, *args, **kwargs):
    made(self, *args, **kwargs)
    senders.append(self)
telemetry_sender.TelemetrySender.__init__ = keep
def settle():
    # events are sent (forked) by the senders' worker threads: wait until none is pending
    deadline = time.monotonic() + 60
    while any(s.queue_size for s in senders) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(s.queue_size for s in senders), "telemetry still pending after 60 s"
import torch
from torch import nn
user_first = sys.argv[1] == "user-first"
if user_first:
    import openvino
settle()
at_import = forks[0]
from xlaunch.kernels.optimize.engines.routes import openvino_route
from xlaunch.kernels.optimize.engines.sample import Sample
from xlaunch.kernels.quantize import engine_routes
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
x = torch.randn(4, 16)
openvino_route.convert(model, Sample(model, (x,)))
if not user_first:
    built = engine_routes.build_openvino(model, (x,), [(torch.randn(4, 16),)], 1, False)
    assert tuple(built.runner(x).shape) == (4, 4)
settle()
ours = forks[0] - at_import
import openvino
openvino.convert_model(model, example_input=x)
settle()
print(json.dumps({"at_import": at_import, "ours": ours, "users_after": forks[0] - at_import - ours,
                  "client_id": os.path.exists(os.path.join(os.environ["HOME"], "intel"))}))
"""


def run(tmp_path: Path, mode: str) -> dict:
    home = tmp_path / mode
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in QUIETING}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_openvino_and_nncf_first_imported_by_xlaunch_send_nothing(tmp_path):
    """Imported by xlaunch: no event from the import, the conversion, NNCF's quantization, and no
    client ID written; they took their no-telemetry path for the process, the user's later calls included."""
    assert run(tmp_path, "xlaunch-first") == {"at_import": 0, "ours": 0, "users_after": 0, "client_id": False}


def test_a_users_openvino_keeps_its_telemetry_and_xlaunchs_calls_send_none(tmp_path):
    """Imported by the user first (their import sends): xlaunch's conversion sends nothing, and the
    user's own conversion afterwards sends again (what xlaunch silenced is restored)."""
    found = run(tmp_path, "user-first")
    assert found["at_import"] >= 1 and found["ours"] == 0 and found["users_after"] >= 1, found
