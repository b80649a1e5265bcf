"""Processes a test started, seen from outside (``from processes import ...``, like host_cpus).

* :func:`leftovers`: live processes whose command line mentions a token (a job's marker);
* :func:`running`: those of some pids that still exist and are not zombies;
* :func:`wait_gone`: wait until none of some pids runs, up to a timeout; what still runs.
"""
from __future__ import annotations

import time

import psutil


def leftovers(token: str) -> list[int]:
    """Live (non-zombie) processes whose command line mentions ``token``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and token in " ".join(proc.info["cmdline"] or ()):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still exist and are not zombies."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for every one of ``pids`` to end; those still running."""
    deadline = time.monotonic() + timeout
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running(pids)
