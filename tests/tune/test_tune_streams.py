"""xlaunch-tune's standard streams closed, full or read by nobody: the session runs, its files are
written and its exit status is its own. It ended at its first stderr line on a full or closed
stderr (before any trial), and after the session at the table on a closed stdout, a full one or a
pipe whose reader left (``| head``), exit status 1 each time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.live


@pytest.mark.parametrize("case", ["stderr full", "stderr closed", "stdout full", "stdout closed", "stdout reader gone",
                                  "json reader gone"])
def test_a_session_outlives_its_standard_streams(tmp_path: Path, case: str) -> None:
    if "full" in case and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false]\n")
    (tmp_path / "prog.py").write_text("print('score: 5')\n")
    argv = [sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--metric", r"score: (\S+)", "--ninstances",
            "1", "--no-plot", "--output-dir", "out", *(["--json"] if "json" in case else []), "prog.py"]
    full = open("/dev/full", "w") if "full" in case else None      # noqa: SIM115
    read, write = os.pipe()
    stream = {"full": full, "closed": None, "gone": write}[case.split()[-1]]
    with open(tmp_path / "err", "w") as err:
        if case.startswith("stderr"):
            keep = () if stream is None else (stream.fileno(),)
            command = argv if stream is not None else ["sh", "-c", 'exec "$@" 2>&-', "sh", *argv]
            done = subprocess.run(command, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=stream or err, timeout=120, pass_fds=keep)
        else:
            os.close(read)                                              # the reader is gone before it starts
            command = argv if stream is not None else ["sh", "-c", 'exec "$@" >&-', "sh", *argv]
            done = subprocess.run(command, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=stream if stream is not None
                                  else subprocess.DEVNULL, stderr=err, timeout=120)
    for fd in (read, write):
        try:
            os.close(fd)
        except OSError:
            pass
    if full is not None:
        full.close()
    stderr = (tmp_path / "err").read_text()
    assert done.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert json.loads((tmp_path / "out" / "trials.json").read_text())["best"] == 1
    assert (tmp_path / "out" / "best.toml").exists()
    if case.startswith("stdout") and case != "stdout closed" or case == "json reader gone":
        assert stderr.splitlines()[-1].startswith("xlaunch-tune: warning: cannot write the results to stdout ("), stderr
        assert stderr.splitlines()[-1].endswith("): they are in out"), stderr


def test_the_progress_bar_is_still_drawn_on_a_terminal(tmp_path: Path) -> None:
    """stderr made forgiving still says it is a terminal: the bar is drawn there."""
    import pty

    pytest.importorskip("rich")
    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false]\n")
    (tmp_path / "prog.py").write_text("print('score: 5')\n")
    leader, follower = pty.openpty()
    tuner = subprocess.Popen([sys.executable, "-m", "xlaunch.tune", "--space", "space.toml", "--metric", r"score: (\S+)",
                              "--ninstances", "1", "--no-plot", "prog.py"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:                 # EIO: the tuner closed its end
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert tuner.wait(60) == 0
    assert b"trial" in shown and b"1/1" in shown, shown[-500:]
