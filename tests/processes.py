"""Processes a test started, seen from outside (``from processes import ...``, like host_cpus).

* :func:`leftovers`: live processes whose command line mentions a token (a job's marker);
* :func:`running`: those of some pids that still exist and are not zombies;
* :func:`wait_gone`: wait until none of some pids runs, up to a timeout; what still runs;
* :func:`free_port`: a TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous).
"""
from __future__ import annotations

import socket
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
