"""While ONNX Runtime quantizes (``engine_routes.quiet``), the user's other threads lose nothing:
their prints on stdout and stderr, their log records and their warnings all arrive, while the
quantizer's own advice (root-logger WARNINGs from the quantizing thread) stays hidden, and an ERROR
it logs is still given out. Before, ``quiet`` swapped the process's ``sys.stdout``/``sys.stderr``
for buffers, set the root logger to ERROR and ignored every warning for the while: the user's
threads' output in that window was dropped. Threads: tested in a fresh process."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

from xlaunch.kernels.quantize import engine_routes  # noqa: E402

pytestmark = pytest.mark.torch

SCRIPT = r'''
import logging, sys, threading, warnings
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
import torch
from torch import nn
import onnxruntime.quantization as q
from xlaunch.kernels.quantize import capture, engine_routes

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
window, stop, sent = threading.Event(), threading.Event(), []

def user() -> None:                       # the user's own thread, busy all along
    i = 0
    while not stop.is_set() or i < 5:
        if window.is_set():
            print(f"user-out {i}", flush=True)
            print(f"user-err {i}", file=sys.stderr, flush=True)
            logging.getLogger("myapp").info("user-log %d", i)
            warnings.warn(f"user-warn {i}", UserWarning)
            i += 1
            if i == 5:
                sent.append(i)
        stop.wait(0.001)

class Helper(threading.Thread):           # a library's own helper thread (rich's progress refresh)
    __module__ = "rich.live"
    def run(self) -> None:
        print("library helper thread", flush=True)

real = q.quantize_static
def quantize_static(*args, **kwargs):     # inside quiet: wait until the user thread wrote in the window
    window.set()
    while not sent:
        stop.wait(0.001)
    print("quantizer stdout")
    logging.getLogger("onnxruntime.quantization").error("quantizer error kept")
    helper = Helper(); helper.start(); helper.join()
    return real(*args, **kwargs)
q.quantize_static = quantize_static

thread = threading.Thread(target=user)
thread.start()
built = engine_routes.build(engine_routes.ONNXRUNTIME, model, (torch.randn(8, 16),),
                            [(torch.randn(8, 16),) for _ in range(3)], seven_bit=False)
stop.set()
thread.join()
assert built.quantized and type(sys.stdout).__name__ == "TextIOWrapper", type(sys.stdout)
print("done")
'''


def test_other_threads_output_survives_an_engine_quantization() -> None:
    if engine_routes.missing(engine_routes.ONNXRUNTIME) is not None:
        pytest.skip(engine_routes.missing(engine_routes.ONNXRUNTIME))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-W", "always::UserWarning", "-c", SCRIPT],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout.splitlines(), proc.stderr
    users = [line for line in out if line.startswith("user-out")]
    assert len(users) >= 5 and out[-1] == "done", out          # every user line in and after the window
    count = len(users)
    assert [f"user-out {i}" for i in range(count)] == users
    for what in ("user-err {}", "INFO myapp user-log {}", "UserWarning: user-warn {}"):
        assert all(what.format(i) in err for i in range(count)), (what, err[-2000:])
    assert "ERROR onnxruntime.quantization quantizer error kept" in err       # an error is given out
    assert "quantizer stdout" not in proc.stdout and "library helper thread" not in proc.stdout
    assert "pre-processing" not in err   # ONNX Runtime's advice (root-logger WARNINGs) stays hidden


NO_STDOUT = r'''
import sys, threading
from xlaunch.kernels.quantize import capture
sys.stdout = None                          # no console (pythonw, a daemon): print() writes nothing
done = []
def user() -> None:
    print("from the user's thread")
    done.append(True)
with capture.quiet_libraries():
    print("held")
    thread = threading.Thread(target=user)
    thread.start()
    thread.join()
assert done == [True] and sys.stdout is None, (done, sys.stdout)
'''


def test_no_stdout_stays_no_stdout() -> None:
    """With ``sys.stdout`` None, the holding wrapped it: the user's thread's print() raised
    AttributeError ('NoneType' object has no attribute 'write') while an engine quantized."""
    proc = subprocess.run([sys.executable, "-c", NO_STDOUT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]


UNDER_RICH_LIVE = r'''
import sys
from rich.console import Console
from rich.file_proxy import FileProxy
from xlaunch.kernels.quantize import capture
console = Console(force_terminal=True)     # as a live display on a terminal sets it up (xlaunch's own bar)
sys.stdout = FileProxy(console, sys.stdout)
with capture.quiet_libraries():
    Console().print("library bar")         # a console made there (NNCF's): writes to rich_proxied_file
print("after", flush=True)
'''


def test_a_console_behind_rich_s_proxy_is_held_too() -> None:
    """On a terminal, xlaunch's progress bar (a rich live display) replaces ``sys.stdout`` with rich's
    FileProxy, and rich consoles write to its ``rich_proxied_file``, the real stream: NNCF's bars got
    past the holding onto the terminal."""
    pytest.importorskip("rich")
    proc = subprocess.run([sys.executable, "-c", UNDER_RICH_LIVE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert "library bar" not in proc.stdout and "after" in proc.stdout, proc.stdout
