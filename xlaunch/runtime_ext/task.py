"""``Task``: run a module or callable on a dedicated thread whose OpenMP team is pinned to a pool.

    with Task(model, CPUPool([1])) as task:
        future = task(x)           # returns at once: a concurrent.futures.Future
        y = future.result()        # the call's result, or its exception re-raised

Calls run one at a time, in submission order, each with its own arguments and with the grad
mode (and inference mode) the caller had when submitting.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Optional, Union

from xlaunch.runtime_ext.pool import CPUPool, pin_team, unpin_team

_STOP = object()


def _caller_modes() -> Optional[tuple[bool, bool]]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


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


def _wait_until_gone(tid: Optional[int], timeout: float = 2.0) -> None:
    """After ``join()`` the kernel thread may still be running its exit (TLS destructors, e.g. the
    OpenMP runtime tearing down the worker's team); wait until ``/proc`` no longer lists it."""
    if tid is None:
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.001)


class Task:
    """A worker thread pinned to ``pool`` that runs ``fn`` for every call, in order.

    ``pool`` defaults to :class:`CPUPool` ``()``. Calling the task submits ``fn(*args, **kwargs)``
    and returns a :class:`~concurrent.futures.Future`. :meth:`close` (or leaving a ``with``
    block) finishes the queued calls and joins the thread.
    """

    def __init__(self, fn: Callable[..., Any], pool: Union[CPUPool, None] = None) -> None:
        if not callable(fn):
            raise TypeError(f"Task needs a module or callable, got {type(fn).__name__}")
        self.fn = fn
        self.pool = pool if pool is not None else CPUPool()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self._closed = False
        started: Future = Future()
        self._thread = threading.Thread(
            target=_serve,
            args=(fn, self.pool.cpus, self._jobs, started),
            name=f"xlaunch-task[{','.join(map(str, self.pool.cpus))}]",
            daemon=True,
        )
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join()
            raise
        self._finalizer = weakref.finalize(self, self._jobs.put, _STOP)

    def __call__(self, *args: Any, **kwargs: Any) -> Future:
        """Queue one call; its arguments belong to this call alone."""
        future: Future = Future()
        job = (future, _caller_modes(), args, kwargs)
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("submit to a closed Task")
            self._jobs.put(job)
        return future

    submit = __call__

    def run_sync(self, *args: Any, **kwargs: Any) -> Any:
        """Submit and wait for the result."""
        return self(*args, **kwargs).result()

    def close(self) -> None:
        """Run what is queued, stop the worker thread and join it (idempotent)."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        if self._thread is not threading.current_thread():
            tid = self._thread.native_id
            self._thread.join()
            _wait_until_gone(tid)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def thread_id(self) -> Optional[int]:
        """Kernel id of the worker thread (None once it has ended)."""
        return self._thread.native_id if self._thread.is_alive() else None

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        name = getattr(type(self.fn), "__name__", "callable")
        return f"Task({name}, {self.pool!r}, {state})"
