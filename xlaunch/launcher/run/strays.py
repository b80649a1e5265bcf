"""Processes of a job that left their instance's process group (``setsid``, a daemon) and were adopted
by xlaunch, the child subreaper, once their parent ended.

They are xlaunch's own children (``/proc/self/task/*/children``) outside every process group it
supervises, other than its helpers (the watchdog) and the children it had before the job
(:class:`Strays` takes that snapshot). While the job runs, those that end are reaped, so a long job
that starts such helpers piles up no zombies; when the job ends, those still running are stopped
like an instance's leftovers (SIGTERM to their process groups, SIGKILL after the grace period) and
named in a warning: nothing of the job outlives xlaunch. Only in a single-threaded launcher (the
``xlaunch`` command): in another program, a child another thread started would look the same.
"""
from __future__ import annotations

import os
import signal
import time

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Callable, Iterable, Optional

    from xlaunch.launcher.run.watchdog import Watchdog

SCAN_INTERVAL = 0.5      # seconds between two looks for ended strays while the job runs


def own_children() -> list[int]:
    """The pids of this process's children (every thread's), as the kernel lists them."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as listing:
                pids.extend(int(pid) for pid in listing.read().split())
        except (OSError, ValueError):
            continue
    return pids


def _reaped(pid: int) -> bool:
    """Reap ``pid`` if it has ended; whether it is gone."""
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        return True
    except InterruptedError:
        return False
    return result is not None and result.si_pid == pid


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read(4096).rstrip(b"\0").split(b"\0")
    except OSError:
        return "?"
    text = " ".join(w.decode(errors="replace") for w in words[:4])
    return text[:80] + ("..." if len(words) > 4 or len(text) > 80 else "")


class Strays:
    """The job's escaped processes: :meth:`reap_ended` while it runs, :meth:`stop` at its end."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.before = set(own_children()) if enabled else set()
        self.next_scan = 0.0
        self.told: dict[int, int] = {}      # running strays whose group the watchdog knows: pid -> pgid

    def find(self, groups: Iterable[int], helpers: Iterable[int]) -> list[int]:
        """Own children outside the process groups ``groups``, other than ``helpers`` and those from before."""
        if not self.enabled:
            return []
        skip, inside = self.before | set(helpers), set(groups)
        found = []
        for pid in own_children():
            try:
                if pid not in skip and os.getpgid(pid) not in inside:
                    found.append(pid)
            except ProcessLookupError:
                continue
        return found

    def reap_ended(self, groups: Iterable[int], helpers: Iterable[int], watchdog: Optional[Watchdog] = None) -> None:
        """Reap the strays that ended (at most every :data:`SCAN_INTERVAL` seconds); tell ``watchdog`` the
        process groups of those still running, so that ``kill -9`` of xlaunch stops them too."""
        now = time.monotonic()
        if self.enabled and now >= self.next_scan:
            self.next_scan = now + SCAN_INTERVAL
            for pid in self.find(groups, helpers):
                if _reaped(pid):
                    self._untell(pid, watchdog)
                elif watchdog is not None and pid not in self.told:
                    try:
                        self.told[pid] = os.getpgid(pid)
                    except ProcessLookupError:
                        continue
                    if list(self.told.values()).count(self.told[pid]) == 1:
                        watchdog.watch(self.told[pid])

    def _untell(self, pid: int, watchdog: Optional[Watchdog]) -> None:
        pgid = self.told.pop(pid, None)
        if watchdog is not None and pgid is not None and pgid not in self.told.values():
            watchdog.forget(pgid)

    def stop(self, helpers: Iterable[int], grace: float, say: Callable[..., None], noun: str) -> None:
        """The job has ended: stop every stray still running and its process group, and say which."""
        helpers = set(helpers)
        for _round in range(3):          # the children of a stopped stray are adopted in turn
            running = [pid for pid in self.find((), helpers) if not _reaped(pid)]
            if not running:
                return
            shown = ", ".join(f"{pid} ({_command(pid)})" for pid in running[:3])
            more = f" and {len(running) - 3} more" if len(running) > 3 else ""
            say(f"{len(running)} process(es) that left their {noun}'s process group (setsid, a daemon) "
                f"ran on after the job: {shown}{more}: SIGTERM, SIGKILL after {grace:g}s", warning=True)
            self._signal(running, signal.SIGTERM)
            self._signal(running, signal.SIGCONT)     # one stopped from outside acts on it
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                running = [pid for pid in running if not _reaped(pid)]
                if not running:
                    break
                time.sleep(0.02)
            self._signal(running, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while running and time.monotonic() < deadline:
                running = [pid for pid in running if not _reaped(pid)]
                time.sleep(0.01)

    @staticmethod
    def _signal(pids: list[int], number: int) -> None:
        for pid in pids:
            try:
                os.killpg(os.getpgid(pid), number)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, number)
                except (ProcessLookupError, PermissionError):
                    pass
