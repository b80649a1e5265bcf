"""examples/infer.py, train.py, dlrm.py as a user runs them first: a bad argument is one error line naming it and
exit status 2 (no traceback, no run that prints a throughput of 0 or nan); the numbers printed are the run's.
Each example's main() runs in this process (torch is imported already; a fresh process would import it again)."""
from __future__ import annotations

import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple:
    """(exit status, stdout, stderr) of ``examples/<name> argv``."""
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)   # run as __main__, the example sets its own
    status = 0
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("name, argv, option", [
    ("infer.py", ["--batch-size", "0"], "--batch-size"),           # printed "throughput: 0.0 img/s"
    ("infer.py", ["--batch-size", "-1"], "--batch-size"),          # a RuntimeError from torch.randn
    ("infer.py", ["--iterations", "0"], "--iterations"),           # "throughput: 0.0 img/s"
    ("infer.py", ["--image-size", "0"], "--image-size"),           # a RuntimeError from inside conv2d
    ("infer.py", ["--seconds", "nan"], "--seconds"),               # "throughput: nan img/s"
    ("infer.py", ["--seconds", "inf"], "--seconds"),               # ran for ever
    ("infer.py", ["--warmup", "-1"], "--warmup"),
    ("train.py", ["--steps", "0"], "--steps"),                     # an AssertionError
    ("train.py", ["--batch-size", "0"], "--batch-size"),           # "final loss nan"
    ("train.py", ["--ddp"], "--ddp"),                              # a ValueError from torch.distributed's rendezvous
    ("dlrm.py", ["--rows", "10", "5"], "--rows"),                  # tables silently the other way round
    ("dlrm.py", ["--lr", "1e308"], "--lr"),                        # a RuntimeError from inside SGD
    ("infer.py", ["--batch-size", "100000000"], "--batch-size"),   # the allocator's RuntimeError: 4.9 TB
    ("infer.py", ["--seconds", "1", "--timeline-dir", "/nonexistent"], "--timeline-dir"),   # a traceback after the run
    ("infer.py", ["--seconds", "1", "--timeline-dir", __file__], "--timeline-dir"),
    ("train.py", ["--batch-size", "1000000000"], "--batch-size"),
    ("dlrm.py", ["--rows", "10", "100000000000", "--tables", "2"], "--rows"),
])
def test_a_bad_argument_is_one_line_and_status_2(name, argv, option, monkeypatch, capsys) -> None:
    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    status, out, err = run(name, argv, monkeypatch, capsys)
    assert status == 2 and out == ""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and option in errors[0] and "Traceback" not in err, err


def test_dlrm_averages_the_losses_it_has(monkeypatch, capsys) -> None:
    """``--steps 1`` trains 3 batches (2 of warm-up): the loss printed is their mean (it divided 3 losses by 4).
    With ``--lr 0`` nothing learns, so the losses are the untrained model's on batches 0, 1 and 2."""
    argv = ["--steps", "1", "--infer-steps", "1", "--tables", "2", "--rows", "5", "9", "--batch-size", "8",
            "--bag", "2", "--dim", "4", "--lr", "0"]
    status, out, _ = run("dlrm.py", argv, monkeypatch, capsys)
    assert status == 0, out
    printed = next(line for line in out.splitlines() if line.startswith("train:"))
    first = float(printed.split("loss ")[1].split(" ->")[0])
    dlrm = runpy.run_path(str(EXAMPLES / "dlrm.py"), run_name="dlrm_example")
    torch.manual_seed(0)
    rows = dlrm["table_rows"](2, 5, 9)
    model = dlrm["DLRM"](rows, 4, "sgd", 0.0)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    with torch.no_grad():
        losses = [loss_fn(model(dense, indices, offsets).float(), labels).item()
                  for dense, indices, offsets, labels in dlrm["make_batches"](rows, 8, 2, 4)[:3]]
    assert first == pytest.approx(sum(losses) / 3, abs=1e-4)


@pytest.mark.parametrize("name, argv", [
    ("infer.py", ["--iterations", "1", "--warmup", "0", "--batch-size", "1", "--image-size", "8"]),
    ("train.py", ["--steps", "1", "--batch-size", "2"]),
    ("dlrm.py", ["--steps", "1", "--infer-steps", "1", "--tables", "2", "--rows", "5", "9", "--batch-size", "8",
                 "--bag", "2", "--dim", "4"]),
    pytest.param("llm.py", ["--tiny", "--new-tokens", "2", "--prompt-tokens", "4"],   # it was the traceback
                 marks=pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")),
])
def test_a_closed_stdout_stops_the_example_without_a_traceback(name, argv, monkeypatch, capsys) -> None:
    """``python examples/infer.py | head -1``: the write after head left was BrokenPipeError's traceback."""
    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    read_end, write_end = os.pipe()
    os.close(read_end)                                   # the reader has gone: every write is EPIPE
    with os.fdopen(write_end, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        status, _, err = run(name, argv, monkeypatch, capsys)
        monkeypatch.undo()
    assert status == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("name", ["infer.py", "train.py", "dlrm.py", "llm.py"])
def test_ctrl_c_ends_the_example_without_a_traceback(name, monkeypatch, capsys) -> None:
    """Run as a program, an example takes a KeyboardInterrupt (or an error a library raised while handling
    one) without a traceback (each printed one, through torch's or transformers' frames); other errors keep
    theirs."""
    status, _, _ = run(name, ["--help"], monkeypatch, capsys)
    hook = sys.excepthook
    monkeypatch.undo()
    assert status == 0 and hook is not sys.excepthook
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ValueError("its config does not build a model") from None   # xlaunch.llm's, mid-import
    except ValueError as error:
        wrapped = error
    for error in (KeyboardInterrupt(), wrapped):
        hook(type(error), error, error.__traceback__)
    assert capsys.readouterr().err == ""
    hook(ValueError, ValueError("a real bug"), None)
    assert "ValueError: a real bug" in capsys.readouterr().err


def test_ctrl_c_while_the_example_runs(tmp_path) -> None:
    """A real SIGINT in the middle of dlrm.py's training: no traceback, a failed status."""
    argv = ["--steps", "1000000", "--tables", "2", "--rows", "5", "9", "--batch-size", "8", "--bag", "2", "--dim", "4"]
    child = subprocess.Popen([sys.executable, str(EXAMPLES / "dlrm.py"), *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert child.stdout.readline().startswith("DLRM-like")   # training starts after this line
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode != 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_the_timeline_folder_is_read_and_written_safely(tmp_path, monkeypatch, capsys) -> None:
    """``--timeline-dir DIR --barrier 1``: what else lies in DIR is read bounded (a FIFO named ready-* blocked
    the barrier for ever, a non-number there was a ValueError traceback) and nothing is written through a link
    planted at the temporary names the files were written under (``<name>.tmp``, predictable from the pid)."""
    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    victim = tmp_path / "victim"
    folder = tmp_path / "timeline"
    folder.mkdir()
    os.mkfifo(folder / "ready-1")
    (folder / "ready-2").write_text("not a time")
    for name in (f"ready-{os.getpid()}.tmp", f"{os.getpid()}.json.tmp"):
        (folder / name).symlink_to(victim)
    argv = ["--seconds", "0.2", "--warmup", "0", "--batch-size", "1", "--image-size", "8", "--timeline-dir",
            str(folder), "--barrier", "1"]
    status, out, err = run("infer.py", argv, monkeypatch, capsys)
    assert status == 0 and "throughput:" in out and "Traceback" not in err, err
    assert not victim.exists()
    assert float((folder / f"ready-{os.getpid()}").read_text()) > 0
    assert "ends" in json.loads((folder / f"{os.getpid()}.json").read_text())
