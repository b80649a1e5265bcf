"""The watchdog: when xlaunch dies without cleaning up (``kill -9``, OOM killer), nothing of the
job keeps running.

``PR_SET_PDEATHSIG`` alone is not enough: it reaches only each instance's first process, as a
signal that a checkpointing trainer may handle or ignore, and never the instance's children. So
xlaunch starts a small watchdog before the first instance starts: this file run as a program of
its own (``python -I -S watchdog.py``, through fork+exec in C: no Python code of xlaunch's runs
in a forked copy, so a lock another thread held at the fork cannot deadlock it, and xlaunch may
have threads). It sits in its own session (a signal to xlaunch's group or the terminal's Ctrl-C
does not reach it), needs only the standard library, ignores SIGINT/SIGTERM/SIGHUP, and reads a
pipe whose only write end xlaunch holds: ``+PGID`` / ``-PGID``
lines as instance process groups start and end, ``done`` on a normal exit. End of file without
``done`` means xlaunch is gone: the watchdog sends SIGTERM to every live group, SIGKILL after the
grace period, and exits.

The torchrun front (:mod:`xlaunch.launcher.distributed.front`) also hands the watchdog the read
end of its rank registry (a FIFO where each rank writes ``+PGID ...`` as it starts): the watchdog
reads it only after xlaunch is gone, so a rank that registered while xlaunch was being killed
is stopped too; once everything is stopped it removes the front's private folder the registry is in
(``xlaunch-front-*``: the ranks' FIFOs, the agent's report), which xlaunch no longer can.

Processes that left an instance's process group (``setsid``, a daemon) are stopped with it: those
xlaunch adopted (their parent ended) because xlaunch announces their groups too (``+PGID``, see
:mod:`.strays`), and those whose parent still runs because the watchdog follows the instances'
descendants in ``/proc`` before it signals anything.

Limits (documented in docs/runner.md): a process started between that look and the SIGTERM, or
adopted by xlaunch less than half a second before it died, is not found; killing the watchdog
itself with SIGKILL leaves only the parent-death signal.
"""
from __future__ import annotations

import os
import signal
import sys
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Optional

POLL = 0.05


class Watchdog:
    """xlaunch's side: :meth:`start`, then :meth:`watch` / :meth:`forget` groups, :meth:`stop`."""

    def __init__(self, pid: int, write_fd: int) -> None:
        self.pid = pid
        self._fd: Optional[int] = write_fd

    @classmethod
    def start(cls, grace_period: float, registry_fd: Optional[int] = None) -> "Watchdog":
        """Start the watchdog (raises OSError when it cannot). ``registry_fd``: a non-blocking
        descriptor with ``+PGID`` lines, read once xlaunch is gone."""
        import subprocess

        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        kept = (read_fd,) if registry_fd is None else (read_fd, registry_fd)
        argv = [sys.executable or "python3", "-I", "-S", os.path.abspath(__file__),
                f"{max(0.0, grace_period):g}", str(read_fd), "-" if registry_fd is None else str(registry_fd)]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, pass_fds=kept, start_new_session=True)
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            os.close(read_fd)
            os.close(write_fd)
            raise OSError(f"cannot start the watchdog: {error}") from None
        os.close(read_fd)
        proc.returncode = 0      # reaped by :meth:`stop` (or the supervisor's own reaping), not by Popen
        return cls(proc.pid, write_fd)

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def stop(self) -> None:
        """Normal end: tell the watchdog to leave everything alone, and reap it."""
        if self._fd is None:
            return
        self._send("done\n")
        os.close(self._fd)
        self._fd = None
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    def _send(self, line: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, line.encode())
        except OSError:  # the watchdog died: nothing to tell any more
            os.close(self._fd)
            self._fd = None


def main(argv: list[str]) -> int:
    """The watchdog's process: ``GRACE READ_FD REGISTRY_FD|-`` (started by :meth:`Watchdog.start`,
    in a session of its own, with only these descriptors and /dev/null as stdio)."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(number, signal.SIG_IGN)
    grace, read_fd, registry = float(argv[0]), int(argv[1]), argv[2]
    _watch(read_fd, grace, None if registry == "-" else int(registry))
    return 0


def _watch(read_fd: int, grace: float, registry_fd: Optional[int] = None) -> None:
    groups: set[int] = set()
    pending = b""
    while True:
        try:
            chunk = os.read(read_fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break  # xlaunch is gone without saying done
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"done":
                return
            if line[:1] == b"+":
                groups.add(int(line[1:].split()[0]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    folder = _front_folder(registry_fd)
    if registry_fd is not None:
        groups |= _registered(registry_fd)
    _stop_groups(groups | _escaped(groups), grace)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _front_folder(registry_fd: Optional[int]) -> Optional[str]:
    """The torchrun front's private folder: where the registry FIFO ``registry_fd`` lies (None: none)."""
    if registry_fd is None:
        return None
    try:
        folder = os.path.dirname(os.readlink(f"/proc/self/fd/{registry_fd}"))
        is_folder = os.path.isdir(folder) and not os.path.islink(folder)
    except OSError:
        return None
    return folder if is_folder and os.path.basename(folder).startswith("xlaunch-front-") else None


def _escaped(groups: set[int]) -> set[int]:
    """The process groups of every descendant of a member of ``groups`` that left them (``setsid``, a
    daemon whose parent still runs), found from ``/proc`` before anything is signalled: once its
    parent ends, such a process is re-parented to init and nothing leads to it any more."""
    parents: dict[int, list[int]] = {}
    group_of: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            ppid, pgid = int(fields[1]), int(fields[2])
        except (OSError, IndexError, ValueError):
            continue
        group_of[int(name)] = pgid
        parents.setdefault(ppid, []).append(int(name))
    frontier = [pid for pid, pgid in group_of.items() if pgid in groups]
    seen, found = set(frontier), set()
    while frontier:
        for child in parents.get(frontier.pop(), ()):
            if child not in seen:
                seen.add(child)
                found.add(group_of[child])
                frontier.append(child)
    return found - groups - {0, 1, os.getpgrp()}


def _registered(fd: int) -> set[int]:
    """Groups announced in the registry that xlaunch did not read before it died."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return {int(line[1:].split()[0]) for line in data.split(b"\n")
            if line[:1] == b"+" and line[1:].split()[:1] and line[1:].split()[0].isdigit()}


def _stop_groups(groups: set[int], grace: float) -> None:
    """SIGTERM every live group (and SIGCONT: a job stopped with Ctrl-Z acts on it), SIGKILL what is left
    after ``grace`` seconds."""
    live = {g for g in groups if _signal_group(g, signal.SIGTERM) and _signal_group(g, signal.SIGCONT)}
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        time.sleep(POLL)
        live = {g for g in live if _signal_group(g, 0)}
    for group in live:
        _signal_group(group, signal.SIGKILL)


def _signal_group(pgid: int, number: int) -> bool:
    try:
        os.killpg(pgid, number)
    except (ProcessLookupError, PermissionError):
        return False
    return True



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
