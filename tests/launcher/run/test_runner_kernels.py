"""--kernel-report in the runner, with real processes and no torch: a program writes recorded
oneDNN lines into the middle of its own output; the console and its log get its own bytes only,
the oneDNN log gets the verbose lines, the summary and its JSON get the report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]
LOGS = REPO / "tests" / "launcher" / "observe" / "onednn_logs"

HARNESS = r"""
import json, os, sys
from xlaunch.launcher.plan.planner import Instance, Plan
from xlaunch.launcher.run.runner import run_plan
spec = json.load(open(sys.argv[1]))
cpus = tuple(sorted(os.sched_getaffinity(0)))[:1]
instances = tuple(Instance(index=i, cpus=cpus, mem_nodes=(), env=dict(os.environ), argv=tuple(argv), bind="none",
                           membind="none") for i, argv in enumerate(spec["argv"]))
sys.exit(run_plan(Plan(instances, kernel_report=True), **spec["options"]))
"""

# The program: each piece is one write(); oneDNN's lines land inside the program's own lines.
WRITER = r"""
import json, os, sys
for piece in json.load(open(sys.argv[1])):
    os.write(1, bytes.fromhex(piece))
"""


def pieces() -> tuple[list[bytes], bytes, bytes]:
    """(writes, the program's own bytes, the verbose lines)."""
    verbose = (LOGS / "amx_eager_f32.log").read_bytes().splitlines(keepends=True)
    writes, user = [], []
    for n, line in enumerate(verbose):
        own = f"step {n}: loss {1 / (n + 1):.4f}\n".encode()
        if n % 3 == 0:          # half a line of ours, oneDNN's whole line, the rest of ours
            writes += [own[:5], line, own[5:]]
        else:
            writes += [own, line]
        user.append(own)
    writes.append(b"done, no newline")
    user.append(b"done, no newline")
    return writes, b"".join(user), b"".join(verbose)


def test_verbose_lines_leave_the_output_and_become_the_report(tmp_path: Path) -> None:
    writes, user, verbose = pieces()
    program = tmp_path / "writes.json"
    program.write_text(json.dumps([w.hex() for w in writes]))
    summary = tmp_path / "summary.json"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "argv": [[sys.executable, "-c", WRITER, str(program)], ["echo", "plain"]],
        "options": {"log_dir": str(tmp_path / "logs"), "summary_json": str(summary), "keep_going": True},
    }))
    proc = subprocess.run([sys.executable, "-c", HARNESS, str(spec)], cwd=REPO, capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err

    console = [line[4:] for line in proc.stdout.split(b"\n") if line.startswith(b"[0] ")]
    assert console == user.split(b"\n")                      # the program's lines, whole and unchanged
    assert b"onednn_verbose" not in proc.stdout
    logs = tmp_path / "logs"
    assert (logs / "xlaunch_instance_0.log").read_bytes() == user
    assert (logs / "xlaunch_instance_0_onednn.log").read_bytes() == verbose
    assert (logs / "xlaunch_instance_1.log").read_bytes() == b"plain\n"
    assert (logs / "xlaunch_instance_1_onednn.log").read_bytes() == b""

    assert ("xlaunch: instance 0 kernels: oneDNN v3.12.0, AMX; convolution: brg_conv_fwd:avx512_core 21 (f32); "
            "reorders 60, of weights 21 (1.00 per call); re-created 0\n") in err
    assert "xlaunch: instance 1 kernels: no oneDNN line" in err
    assert "xlaunch: warning: instance 0: AMX available but not used (convolution brg_conv_fwd:avx512_core, f32)" in err
    assert "xlaunch: warning: instance 0: weights re-laid-out on every call" in err
    assert err.rstrip().endswith("xlaunch: exit status 0")
    assert "kernels:" in (logs / "xlaunch_launcher.log").read_text()

    data = json.loads(summary.read_text())
    kernels = [instance["observed"]["kernels"] for instance in data["instances"]]
    assert kernels[0]["isa"].startswith("Intel AVX-512 with float16") and kernels[0]["lines"] == len(verbose.splitlines())
    assert kernels[0]["primitives"]["convolution"]["implementations"] == {"brg_conv_fwd:avx512_core": 21}
    assert kernels[1]["lines"] == 0
