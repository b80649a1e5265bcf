"""--kernel-report in ranks: ``xlaunch --per-rank`` becomes the program (same pid, same exit
status) with a filter process on its stdout; the torchrun front forwards the option to its ranks.
Real processes, no torch: the program replays a recorded oneDNN log inside its own lines."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from host_cpus import without_budget_warning
from machine_trees import machine_tree
from processes import leftovers

from xlaunch.launcher.observe.kernel_report import RELAYOUT_ADVICE

pytestmark = pytest.mark.live

REPO = Path(__file__).resolve().parents[3]
LOG = REPO / "tests" / "launcher" / "observe" / "onednn_logs" / "avx2_eager_f32.log"
PROGRAM = f"""\
import os, sys
for n, line in enumerate(open({str(LOG)!r}, "rb").read().splitlines(keepends=True)):
    os.write(1, b"mine %d " % n)      # half a line of ours, oneDNN's whole line, the rest of ours
    os.write(1, line)
    os.write(1, b"end\\n")
os.write(1, b"pid %d\\n" % os.getpid())
if sys.argv[1] == "wait":
    sys.stdin.read()                  # until the test signals us
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""
EXPECTED = b"".join(b"mine %d end\n" % n for n in range(len(LOG.read_bytes().splitlines())))


def rank(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, str]:
    token = uuid.uuid4().hex
    program = tmp_path / f"rank_{token}.py"
    program.write_text(PROGRAM)
    env = {**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "RANK": "3", "WORLD_SIZE": "4"}
    proc = subprocess.Popen([sys.executable, "-m", "xlaunch", "--per-rank", "--kernel-report", str(program), mode],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    return proc, token




def test_rank_is_its_program_and_its_output_is_clean(tmp_path: Path) -> None:
    proc, token = rank(tmp_path, "3")
    out, err = proc.communicate(timeout=60)      # both pipes at end of file: the filter is gone too
    assert proc.returncode == 3                  # the program's own status
    assert out == EXPECTED + b"pid %d\n" % proc.pid   # the engine's pid is the program's
    lines = without_budget_warning(err.decode()).splitlines()
    assert lines == [
        "xlaunch: rank 3 kernels: oneDNN v3.12.0, AVX2; convolution: jit:avx2 21 (f32); reorders 60, of weights 21 "
        "(1.00 per call); re-created 0",
        "xlaunch: warning: rank 3: weights re-laid-out on every call (convolution: 21 weight reorders in 21 calls): "
        f"{RELAYOUT_ADVICE}",
    ]
    assert leftovers(token) == []


def test_a_stopped_rank_still_gets_its_output_and_report(tmp_path: Path) -> None:
    proc, token = rank(tmp_path, "wait")
    assert proc.stdout is not None
    seen = b""
    while not seen.endswith(b"pid %d\n" % proc.pid):
        seen += proc.stdout.read1(1 << 16)
    os.killpg(proc.pid, signal.SIGTERM)          # the engine stopping the rank: the filter ignores it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert seen + out == EXPECTED + b"pid %d\n" % proc.pid
    assert "xlaunch: rank 3 kernels: oneDNN v3.12.0, AVX2;" in err.decode()
    assert leftovers(token) == []


def test_front_forwards_the_option_to_every_rank() -> None:
    # planned for a recorded machine: two ranks fit whatever this process may use
    env = {**os.environ, "XLAUNCH_FSROOT": str(machine_tree("xeon-2s-amx"))}
    out = subprocess.run([sys.executable, "-m", "xlaunch", "--nproc-per-node", "2", "--kernel-report", "--dry-run",
                          "--json", "--master-addr", "127.0.0.1", "--master-port", "29999", str(LOG)],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    command = data["distributed"]["rank_command"]
    assert command[command.index("--per-rank"):].count("--kernel-report") == 1
    assert all(instance["env"]["ONEDNN_VERBOSE"] == "profile_create" for instance in data["instances"])


@pytest.mark.parametrize("shared", [True, False])
def test_report_after_an_unfinished_last_line(shared: bool) -> None:
    """A rank's stdout and stderr share its FIFO: a program whose last line has no newline gets the report on a
    line of its own there (it was glued to the program's text); apart, stderr gets no empty line."""
    from xlaunch.launcher.run.kernel_tee import serve

    source_r, source_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = (os.dup(out_r), os.dup(out_w)) if shared else os.pipe()
    os.write(source_w, LOG.read_bytes() + b"progress 99%")
    os.close(source_w)
    serve(source_r, out_w, err_w, "rank 1")
    for fd in (source_r, out_w, err_w):
        os.close(fd)
    with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
        text, report = out.read(), b"" if shared else err.read()
    if shared:
        text, _, report = text.partition(b"\n")
    assert text == b"progress 99%"
    assert report.startswith(b"xlaunch: rank 1 kernels: oneDNN v3.12.0, AVX2;")
