"""The watchdog is a program of its own (exec'd, not a forked copy of the launcher running Python),
so it starts safely while the launcher has threads; it stops the groups it was told about once
the launcher is gone, and leaves them alone after ``done``."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings

from xlaunch.launcher.run import watchdog as module
from xlaunch.launcher.run.watchdog import Watchdog

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")


def cmdline(pid: int) -> list[str]:
    """The process's argv. Right after ``Popen`` returns, a child started by vfork may still be
    inside execve (the parent resumes once the old memory is released, before the new argv is set
    up): its cmdline reads empty for a moment, most often on a loaded machine. Wait for it."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as text:
            parts = [part.decode() for part in text.read().split(b"\0") if part]
        if parts or time.monotonic() > deadline:
            return parts
        time.sleep(0.005)


def test_the_watchdog_is_exec_d_in_a_session_of_its_own_while_threads_run() -> None:
    release = threading.Event()
    busy = threading.Thread(target=release.wait, daemon=True)
    busy.start()                                      # the launcher is multi-threaded now
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")            # Python 3.12+ warns on fork() with threads
            dog = Watchdog.start(0.1)
        try:
            argv = cmdline(dog.pid)
            assert argv != cmdline(os.getpid())       # a forked copy would still show ours
            assert os.path.samefile(argv[3], module.__file__) and argv[1:3] == ["-I", "-S"], argv
            assert os.getsid(dog.pid) == dog.pid      # Ctrl-C and signals to our group miss it
            assert sorted(int(fd) for fd in os.listdir(f"/proc/{dog.pid}/fd"))[:3] == [0, 1, 2]
            assert os.readlink(f"/proc/{dog.pid}/fd/1") == os.devnull
        finally:
            dog.stop()
    finally:
        release.set()
        busy.join()


def test_launcher_gone_stops_the_groups_it_was_told_about() -> None:
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert stubborn.stdout.readline() == b"ready\n"
        dog = Watchdog.start(0.3)
        dog.watch(stubborn.pid)
        os.close(dog._fd)                 # what the kernel does when xlaunch is killed
        dog._fd = None
        started = time.monotonic()
        assert stubborn.wait(timeout=10) == -signal.SIGKILL        # SIGTERM ignored, SIGKILL after 0.3 s
        assert time.monotonic() - started < 3
        assert os.waitpid(dog.pid, 0)[1] == 0
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()
        stubborn.stdout.close()


def test_done_leaves_the_groups_alone() -> None:
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert stubborn.stdout.readline() == b"ready\n"
        dog = Watchdog.start(0.1)
        dog.watch(stubborn.pid)
        dog.stop()                        # "done", then reaped
        time.sleep(0.3)
        assert stubborn.poll() is None
    finally:
        stubborn.kill()
        stubborn.wait()
        stubborn.stdout.close()
