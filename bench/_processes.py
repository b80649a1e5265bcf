"""The launches a bench times, stopped with everything they started.

A launcher's programs are not always in its process group: torch's ``run_cpu`` and ``torchrun``
start theirs in sessions of their own (torch.distributed.elastic), and neither stops them when it
is killed. So a launch runs in a session of its own and, at its time limit, at Ctrl-C or at the
bench's SIGTERM, its whole tree (the processes under it, listed before any is signalled, and its
group) gets SIGTERM, then SIGKILL after ``grace`` seconds. Imports no torch.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Sequence, Union

import psutil

Status = Union[int, str]          # an exit status, or "timeout"


def run_tree(argv: Sequence[str], timeout: float, grace: float = 10.0,
             **popen: Any) -> tuple[Status, bytes, bytes]:
    """Run ``argv`` (``stdout``/``stderr`` default to pipes, ``stdin`` to /dev/null) until it exits or
    ``timeout`` seconds pass; (its exit status or ``"timeout"``, its stdout, its stderr: what it wrote
    before it was stopped). Any exception (KeyboardInterrupt, :func:`exit_on_sigterm`'s SystemExit)
    stops the tree first and goes on."""
    popen.setdefault("stdin", subprocess.DEVNULL)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(list(argv), start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out or b"", err or b""
    except subprocess.TimeoutExpired:
        out, err = stop_tree(proc, grace)
        return "timeout", out, err
    except BaseException:
        stop_tree(proc, grace)
        raise


def stop_tree(proc: subprocess.Popen, grace: float = 10.0) -> tuple[bytes, bytes]:
    """SIGTERM ``proc``, every process under it and its process group; SIGKILL what is left after
    ``grace`` s (at once if the wait is interrupted). Returns the output still in its pipes."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:             # already gone
        tree = []
    got: list[tuple[bytes, bytes]] = []
    try:
        _signal(proc, tree, signal.SIGTERM)
        if not _ended(proc, tree, grace, got):
            _signal(proc, tree, signal.SIGKILL)
            _ended(proc, tree, 5.0, got)
    except BaseException:
        _signal(proc, tree, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    return got[0] if got else (b"", b"")


def _signal(proc: subprocess.Popen, tree: list[psutil.Process], number: int) -> None:
    if proc.poll() is None:
        proc.send_signal(number)
    for member in tree:
        try:
            member.send_signal(number)        # psutil checks the pid is still that process
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def _ended(proc: subprocess.Popen, tree: list[psutil.Process], seconds: float,
           got: list[tuple[bytes, bytes]]) -> bool:
    """Whether ``proc`` and its tree ended within ``seconds``; ``proc``'s output, once its pipes are
    closed by all, goes to ``got`` (read while waiting, so a full pipe never blocks its writer)."""
    deadline = time.monotonic() + seconds
    if not got:
        try:
            out, err = proc.communicate(timeout=seconds)
            got.append((out or b"", err or b""))
        except subprocess.TimeoutExpired:      # it, or something under it, still holds a pipe
            pass
    if proc.poll() is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    while any(_running(member) for member in tree):        # a zombie waiting for init to reap it has ended
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _running(member: psutil.Process) -> bool:
    try:
        return member.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def exit_on_sigterm() -> None:
    """SIGTERM ends the bench as Ctrl-C does: the launch it is timing is stopped with its tree and
    its scratch files are removed (``finally`` blocks run); exit status 143."""
    def stop(number: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)        # a second SIGTERM ends it at once
        print(f"{os.path.basename(sys.argv[0])}: terminated, stopping what it started", file=sys.stderr, flush=True)
        raise SystemExit(128 + number)

    signal.signal(signal.SIGTERM, stop)


class _Output:
    """``sys.stdout`` that outlives its reader: the first failed write or flush (``| head`` closed the pipe, the
    terminal went away, the disk is full) is said once on stderr and sends the rest to /dev/null."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._lost = stream, False

    def _lose(self, error: OSError) -> None:
        self._lost = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())           # its buffer's last flush at exit goes nowhere
            os.close(devnull)
            print(f"{os.path.basename(sys.argv[0])}: stdout failed ({error.strerror or error}); the run goes on "
                  "without it (--json, if given, is still written)", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        if not self._lost:
            try:
                return self._stream.write(text)
            except OSError as error:
                self._lose(error)
        return len(text)

    def flush(self) -> None:
        if not self._lost:
            try:
                self._stream.flush()
            except OSError as error:
                self._lose(error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_closed_stdout() -> None:
    """A closed or failing stdout degrades the bench's output, never its run (:class:`_Output`)."""
    if not isinstance(sys.stdout, _Output) and sys.stdout is not None:
        sys.stdout = _Output(sys.stdout)
