"""``Task``: run a module or callable on a dedicated thread whose OpenMP team is pinned to a pool.

    with Task(model, CPUPool([1])) as task:
        future = task(x)           # returns at once: a concurrent.futures.Future
        y = future.result()        # the call's result, or its exception re-raised (IPEX: .get())

Calls run one at a time, in submission order, each with its own arguments and with the grad
mode (and inference mode) the caller had when submitting.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Optional

from xlaunch.runtime_ext import workers
from xlaunch.runtime_ext.pool import CPUPool, pin_team, unpin_team

_STOP = object()


class TaskFuture(Future):
    """The pending result of one Task call: a :class:`~concurrent.futures.Future` that also has
    IPEX's ``get()``."""

    def get(self, timeout: Optional[float] = None) -> Any:
        """The call's result (its exception re-raised); waits up to ``timeout`` seconds."""
        return self.result(timeout)


def _caller_modes() -> Optional[tuple[bool, bool]]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


class _Inbox:
    """A worker's queue of calls and whether it still takes any.

    Shared by the :class:`Task`, its finalizer and the exit hook, and holding no reference to
    the Task, so a dropped Task can be collected (which closes the inbox).
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.closed = False

    def put(self, job: tuple) -> None:
        with self.lock:
            if self.closed:
                raise RuntimeError("submit to a closed Task")
            self.jobs.put(job)

    def cancel_queued(self) -> int:
        """Cancel the calls not yet started (their futures raise ``CancelledError``); how many."""
        cancelled, stop = 0, False
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                stop = True
            elif job[0].cancel():
                cancelled += 1
        if stop:
            self.jobs.put(_STOP)
        return cancelled

    def close(self) -> None:
        """Take no more calls; the worker stops after the ones queued (idempotent)."""
        with self.lock:
            if not self.closed:
                self.closed = True
                self.jobs.put(_STOP)


def _call_with_modes(fn: Callable[..., Any], modes: Optional[tuple[bool, bool]], args: tuple, kwargs: dict) -> Any:
    if modes is None:
        return fn(*args, **kwargs)
    import torch

    grad, inference = modes
    if inference:
        with torch.inference_mode():
            return fn(*args, **kwargs)
    with torch.set_grad_enabled(grad):
        return fn(*args, **kwargs)


def _serve(fn: Callable[..., Any], cpus: tuple[int, ...], jobs: queue.SimpleQueue, started: Future) -> None:
    """The worker thread: pin, then run jobs until told to stop; unpin on the way out."""
    try:
        pinned = pin_team(cpus)
    except BaseException as error:  # noqa: BLE001 - reported to the constructor
        started.set_exception(error)
        return
    started.set_result(None)
    try:
        while True:
            job = jobs.get()
            if job is _STOP:
                break
            future, modes, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = _call_with_modes(fn, modes, args, kwargs)
            except BaseException as error:  # noqa: BLE001 - delivered through the future
                future.set_exception(error)
            else:
                future.set_result(result)
            del job, future, args, kwargs
    finally:
        unpin_team(pinned)


class Task:
    """A worker thread pinned to ``pool`` that runs ``fn`` for every call, in order.

    ``cpu_pool`` defaults to :class:`CPUPool` ``()`` (``pool=`` is accepted too). Calling the
    task submits ``fn(*args, **kwargs)`` and returns a :class:`TaskFuture`. :meth:`close` (or
    leaving a ``with`` block) finishes the queued calls and joins the thread. A dropped Task stops its
    thread; at interpreter exit every open Task finishes its queue and is joined before the
    interpreter finalizes (see :mod:`xlaunch.runtime_ext.workers`). In a forked child the
    parent's Task has no thread: using it raises :class:`RuntimeError`.
    """

    def __init__(
        self, fn: Callable[..., Any], cpu_pool: Optional[CPUPool] = None, *, pool: Optional[CPUPool] = None
    ) -> None:
        if not callable(fn):
            raise TypeError(f"Task needs a module or callable, got {type(fn).__name__}")
        if cpu_pool is not None and pool is not None:
            raise TypeError("give cpu_pool or pool, not both")
        chosen = cpu_pool if cpu_pool is not None else pool
        if chosen is not None and not isinstance(chosen, CPUPool):
            raise TypeError(f"cpu_pool must be a CPUPool, got {type(chosen).__name__}")
        self.fn = fn
        self.pool = chosen if chosen is not None else CPUPool()
        self._inbox = _Inbox()
        started: Future = Future()
        self._thread = threading.Thread(
            target=_serve,
            args=(fn, self.pool.cpus, self._inbox.jobs, started),
            name=f"xlaunch-task[{','.join(map(str, self.pool.cpus))}]",
            daemon=True,
        )
        self._thread.start()
        self._worker = workers.register(self._thread, self._inbox.close, self._inbox.cancel_queued)
        try:
            started.result()
        except BaseException:
            self._worker.join()
            raise
        # A dropped Task stops its thread; the exit hook joins it (see xlaunch.runtime_ext.workers).
        self._finalizer = weakref.finalize(self, self._inbox.close)
        self._finalizer.atexit = False

    @property
    def cpu_pool(self) -> CPUPool:
        return self.pool

    def __call__(self, *args: Any, **kwargs: Any) -> TaskFuture:
        """Queue one call; its arguments belong to this call alone."""
        future = TaskFuture()
        job = (future, _caller_modes(), args, kwargs)
        workers.check_owner(self._worker.pid, "Task")
        self._inbox.put(job)
        return future

    submit = __call__

    def run_sync(self, *args: Any, **kwargs: Any) -> Any:
        """Submit and wait for the result."""
        return self(*args, **kwargs).result()

    def close(self, cancel_queued: bool = False) -> None:
        """Run what is queued (``cancel_queued``: cancel the calls not yet started instead), stop
        the worker thread and join it (idempotent). Interrupted (Ctrl-C), it cancels the queued
        calls before the KeyboardInterrupt goes on, so only the call in progress is left."""
        self._finalizer.detach()
        if self._worker.pid != os.getpid():
            self._inbox.closed = True  # a forked child: the worker is the parent's, nothing to stop
            return
        if cancel_queued:
            self._inbox.close()
            self._inbox.cancel_queued()
        try:
            self._worker.join()  # closes the inbox, waits for the queued calls and the thread's end
        except KeyboardInterrupt:
            self._inbox.cancel_queued()
            raise

    @property
    def closed(self) -> bool:
        return self._inbox.closed

    @property
    def thread_id(self) -> Optional[int]:
        """Kernel id of the worker thread (None once it has ended)."""
        return self._thread.native_id if self._thread.is_alive() else None

    def __enter__(self) -> Task:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(cancel_queued=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        name = getattr(type(self.fn), "__name__", "callable")
        return f"Task({name}, {self.pool!r}, {state})"
