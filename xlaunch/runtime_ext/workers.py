"""Lifetime of the runtime's worker threads: stopped and joined before the interpreter finalizes.

Why this exists: once ``Py_FinalizeEx`` starts, CPython ends any thread that tries to take the
GIL with ``pthread_exit``. A worker woken at exit (or still finishing a call) often takes the
GIL inside a torch destructor -- a tensor freed on the worker decrefs its Python object -- and
the forced unwind through that ``noexcept`` C++ frame calls ``std::terminate``: the process
dies with "terminate called without an active exception" (SIGABRT, exit 134).

So every worker thread is registered here, and an ``atexit`` hook stops and joins them all.
``atexit`` runs after the interpreter has joined the user's non-daemon threads (they may still
use a Task) and before finalization begins. A joined thread may still be in its C-level exit
(the OpenMP runtime releasing the thread's team), so the hook also waits until the kernel no
longer lists it. In a forked child none of the parent's threads exist: the registry is emptied
and the objects owning them refuse work (:func:`check_owner`).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

# How long to wait for a joined thread to leave /proc/self/task (its C-level exit).
EXIT_GRACE_S = 2.0


@dataclass(eq=False)
class Worker:
    """One runtime thread and how to ask it to stop (the request must not block)."""

    thread: threading.Thread
    request_stop: Callable[[], None]   # idempotent, never blocks for long
    pid: int = field(default_factory=os.getpid)
    cancel_queued: Callable[[], int] = lambda: 0   # cancels the calls not yet started; how many

    def stop(self) -> None:
        """Ask the thread to stop; a no-op in a process other than the one that started it."""
        if self.pid == os.getpid():
            self.request_stop()

    def join(self) -> None:
        """Stop, join and wait until the kernel thread is gone (not from the thread itself)."""
        self.stop()
        if self.pid != os.getpid() or self.thread is threading.current_thread():
            return
        tid = self.thread.native_id
        self.thread.join()
        wait_until_gone(tid)
        forget(self)


_lock = threading.Lock()
_live: set[Worker] = set()
_hooked = False


def register(
    thread: threading.Thread, request_stop: Callable[[], None], cancel_queued: Optional[Callable[[], int]] = None
) -> Worker:
    """Track a started ``thread`` until it is joined; installs the exit and fork hooks once."""
    global _hooked
    worker = Worker(thread, request_stop)
    if cancel_queued is not None:
        worker.cancel_queued = cancel_queued
    with _lock:
        if not _hooked:
            atexit.register(shutdown_all)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_forget_parent_threads)
            _hooked = True
        _prune()
        _live.add(worker)
    return worker


def forget(worker: Worker) -> None:
    with _lock:
        _live.discard(worker)


def live_workers() -> tuple[Worker, ...]:
    """Registered workers not yet joined (for tests and diagnostics)."""
    with _lock:
        return tuple(_live)


def shutdown_all() -> None:
    """Stop every registered worker, then join them all (the ``atexit`` hook; safe to call twice).

    A Ctrl-C while it waits cancels the queued calls and waits only for those in progress (a
    worker still running when the interpreter finalizes aborts the process); one line on stderr
    says so. A second Ctrl-C leaves at once with status 130 (``os._exit``, output flushed).
    """
    workers: tuple[Worker, ...] = ()
    try:
        workers = live_workers()
        for worker in workers:  # a Ctrl-C here too: the workers must still be stopped and joined
            worker.stop()
        _join_all(workers)
    except KeyboardInterrupt:
        try:
            workers = workers or live_workers()
            cancelled = sum(worker.cancel_queued() for worker in workers)
            _say(f"xlaunch.runtime_ext: interrupted at exit: {cancelled} queued Task call(s) cancelled; waiting "
                 "for the calls in progress (Ctrl-C again to leave at once)")
            _join_all(workers)
        except KeyboardInterrupt:
            _say("xlaunch.runtime_ext: interrupted again at exit: leaving without waiting for the Task calls in progress")
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            os._exit(130)


def _join_all(workers: tuple[Worker, ...]) -> None:
    for worker in workers:
        worker.join()


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass  # a closed or full stderr does not change what happens


def wait_until_gone(tid: Optional[int], timeout: float = EXIT_GRACE_S) -> None:
    """Wait until ``/proc/self/task/<tid>`` disappears: after ``join()`` the kernel thread may still
    be running its exit (TLS destructors, e.g. the OpenMP runtime tearing down the thread's team)."""
    if tid is None:
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.001)


def _prune() -> None:
    """Drop entries of threads that ended on their own (e.g. a Task dropped without close())."""
    for worker in [w for w in _live if not w.thread.is_alive()]:
        tid = worker.thread.native_id
        if tid is None or not os.path.exists(f"/proc/self/task/{tid}"):
            _live.discard(worker)


def _forget_parent_threads() -> None:
    """In a forked child: the parent's workers do not exist here; nothing to stop or join."""
    global _lock
    _lock = threading.Lock()  # the parent may have held it while forking
    _live.clear()


def check_owner(pid: int, what: str) -> None:
    """Raise when an object whose threads were started by process ``pid`` is used in a fork child."""
    if pid != os.getpid():
        raise RuntimeError(
            f"this {what} was created in process {pid}; its worker threads do not exist in this "
            f"forked process {os.getpid()}: create a new {what} here"
        )
