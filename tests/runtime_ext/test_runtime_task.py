"""Task: pinned worker thread, futures, per-call arguments, order, grad mode, clean shutdown."""
from __future__ import annotations

import os
import threading
from concurrent.futures import wait

import pytest

torch = pytest.importorskip("torch")

from _runtime_helpers import thread_cpus, thread_ids  # noqa: E402

from xlaunch.runtime_ext import CPUPool, Task, threadpool_info  # noqa: E402

ALLOWED = tuple(sorted(os.sched_getaffinity(0)))


def where_am_i() -> tuple:
    return thread_cpus(threading.get_native_id()), torch.get_num_threads()


def test_worker_thread_is_pinned_and_caller_untouched():
    with Task(where_am_i, CPUPool([ALLOWED[-1]])) as task:
        assert task().result(timeout=60) == ((ALLOWED[-1],), 1)
        assert thread_cpus(task.thread_id) == (ALLOWED[-1],)
    assert thread_cpus(threading.get_native_id()) == ALLOWED


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed CPUs")
def test_worker_team_is_pinned_to_the_whole_pool():
    with Task(lambda: [m.cpus for m in threadpool_info().team], CPUPool([ALLOWED[1], ALLOWED[0]])) as task:
        assert task().result(timeout=60) == [(ALLOWED[1],), (ALLOWED[0],)]


def test_exception_reaches_result():
    def fail(x):
        raise ZeroDivisionError(f"no {x}")

    with Task(fail, CPUPool([ALLOWED[0]])) as task:
        future = task(7)
        with pytest.raises(ZeroDivisionError, match="no 7"):
            future.result(timeout=60)
        assert isinstance(future.exception(), ZeroDivisionError)
        # the worker survives a failing call
        with pytest.raises(ZeroDivisionError):
            task.run_sync(8)


def test_each_submit_keeps_its_own_arguments():
    model = torch.nn.Linear(4, 3).eval()
    inputs = [torch.full((2, 4), float(i)) for i in range(20)]
    with torch.no_grad(), Task(model, CPUPool([ALLOWED[0]])) as task:
        futures = [task(x) for x in inputs]
        for x, future in zip(inputs, futures):
            assert torch.equal(future.result(timeout=60), model(x))
        assert task(input=inputs[3]).result(timeout=60).shape == (2, 3)


def test_grad_and_inference_mode_of_the_caller_are_carried():
    probe = lambda: (torch.is_grad_enabled(), torch.is_inference_mode_enabled())  # noqa: E731
    with Task(probe, CPUPool([ALLOWED[0]])) as task:
        with torch.no_grad():
            no_grad = task()
        with torch.enable_grad():
            grad = task()
        with torch.inference_mode():
            inference = task()
        assert no_grad.result(timeout=60) == (False, False)
        assert grad.result(timeout=60) == (True, False)
        assert inference.result(timeout=60) == (False, True)



def test_thousand_concurrent_submits_finish_in_order_per_task():
    logs: list[list] = [[], []]
    tasks = [Task(logs[i].append, CPUPool([ALLOWED[i % len(ALLOWED)]])) for i in range(2)]
    submitters, per_submitter = 4, 250
    futures: list = []
    lock = threading.Lock()
    start = threading.Barrier(submitters)

    def submit(s: int) -> None:
        start.wait()
        mine = [tasks[n % 2]((s, n)) for n in range(per_submitter)]
        with lock:
            futures.extend(mine)

    workers = [threading.Thread(target=submit, args=(s,)) for s in range(submitters)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    done, pending = wait(futures, timeout=60)
    for task in tasks:
        task.close()
    assert not pending and len(done) == submitters * per_submitter
    assert sum(map(len, logs)) == 1000
    for i, log in enumerate(logs):
        for s in range(submitters):
            sequence = [n for (who, n) in log if who == s]
            assert sequence == [n for n in range(per_submitter) if n % 2 == i]


def test_no_thread_left_after_close():
    before_python = set(threading.enumerate())
    before_kernel = thread_ids()
    task = Task(lambda x: x + 1, CPUPool([ALLOWED[-1]]))
    tid = task.thread_id
    assert tid in thread_ids()
    assert task(1).result(timeout=60) == 2
    task.close()
    task.close()  # idempotent
    assert task.thread_id is None and tid not in thread_ids()
    assert set(threading.enumerate()) == before_python
    assert thread_ids() <= before_kernel
    with pytest.raises(RuntimeError, match="closed"):
        task(1)


def test_a_dropped_task_stops_its_thread():
    import gc

    task = Task(lambda: None, CPUPool([ALLOWED[0]]))
    thread = task._thread
    del task
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_bad_pool_fails_in_the_constructor():
    with pytest.raises(ValueError, match="not allowed"):
        Task(lambda: None, CPUPool([max(ALLOWED) + 1]))
    with pytest.raises(TypeError, match="callable"):
        Task(42, CPUPool([ALLOWED[0]]))


def test_closed_and_dropped_tasks_leave_the_exit_registry():
    import gc

    from xlaunch.runtime_ext import workers

    with Task(lambda: None, CPUPool([ALLOWED[0]])) as task:
        assert task._worker in workers.live_workers()
    assert task._worker not in workers.live_workers()
    dropped = Task(lambda: None, CPUPool([ALLOWED[0]]))
    worker = dropped._worker
    del dropped
    gc.collect()
    worker.thread.join(timeout=30)
    workers.wait_until_gone(worker.thread.native_id)
    Task(lambda: None, CPUPool([ALLOWED[0]])).close()  # registering prunes threads that ended
    assert worker not in workers.live_workers()


def test_the_exit_hook_runs_queued_calls_then_closes_open_tasks():
    from xlaunch.runtime_ext import workers

    done = []
    task = Task(lambda i: done.append(i) or torch.ones(2).sum(), CPUPool([ALLOWED[0]]))
    futures = [task(i) for i in range(20)]
    tid = task.thread_id
    workers.shutdown_all()
    assert done == list(range(20)) and all(f.done() for f in futures)
    assert task.closed and tid not in thread_ids() and not task._worker.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        task(1)
    task.close()


def test_close_from_inside_the_task_does_not_deadlock():
    holder: list = []
    task = Task(lambda: holder[0].close(), CPUPool([ALLOWED[0]]))
    holder.append(task)
    task().result(timeout=60)
    assert task.closed
    task._worker.thread.join(timeout=30)
    assert not task._worker.thread.is_alive()


def test_ctrl_c_inside_a_with_block_cancels_the_queued_calls():
    """Leaving a ``with Task``/``MultiStreamModule`` block by KeyboardInterrupt waited for every
    queued call first (13 s for 20000 small calls); now the calls not yet started are cancelled,
    as ``close(cancel_queued=True)`` does. Another exception still runs them (close())."""
    import time
    from concurrent.futures import CancelledError

    from xlaunch.runtime_ext import MultiStreamModule

    def slow(x):
        time.sleep(0.01)
        return x

    for make in (lambda: Task(slow, CPUPool([ALLOWED[0]])),
                 lambda: MultiStreamModule(slow, 1, CPUPool([ALLOWED[0]]))):
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with make() as runner:
                task = runner if isinstance(runner, Task) else runner._tasks[0]
                futures = [task(torch.ones(1)) for _ in range(2000)]    # 20 s of calls
                raise KeyboardInterrupt
        assert time.monotonic() - started < 10
        assert runner.closed and sum(f.cancelled() for f in futures) > 1900
        with pytest.raises(CancelledError):
            futures[-1].result()
    with Task(slow, CPUPool([ALLOWED[0]])) as task:
        futures = [task(torch.ones(1)) for _ in range(200)]
        task.close(cancel_queued=True)
    assert sum(f.cancelled() for f in futures) > 150 and all(f.done() for f in futures)
    with pytest.raises(ValueError):
        with Task(slow, CPUPool([ALLOWED[0]])) as task:
            futures = [task(torch.ones(1)) for _ in range(20)]
            raise ValueError
    assert all(f.result() is not None for f in futures)
