"""``MultiStreamModule``: one model, several pinned streams, each running a slice of the batch.

    msm = MultiStreamModule(model, num_streams=2, cpu_pool=CPUPool([0, 1]))
    y = msm(x)                     # x split on dim 0, each slice on its own core, y concatenated

Each stream is a :class:`~xlaunch.runtime_ext.task.Task` on a slice of the pool, so a stream's
OpenMP team (and torch's intra-op work) stays on its own cores.
"""
from __future__ import annotations

import warnings
from concurrent.futures import wait
from typing import Any, Optional, Union

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    from torch import nn

from xlaunch.runtime_ext.batching import (
    MultiStreamModuleHint,
    StreamHint,
    checked_hint,
    common_batch,
    get_default_num_streams,
    join_outputs,
    output_hint,
    slice_sizes,
    split_call,
)
from xlaunch._errors import as_index
from xlaunch.runtime_ext.pool import CPUPool
from xlaunch.runtime_ext.task import Task

AUTO = "auto"


def auto_streams(pool: CPUPool) -> int:
    """``num_streams="auto"``: one stream per CPU of the pool (throughput first)."""
    return get_default_num_streams(pool)


def stream_count(num_streams: Union[int, str], pool: CPUPool) -> int:
    """``num_streams`` checked: ``"auto"`` (any case, IPEX writes ``"AUTO"``) or a positive int;
    more streams than CPUs become one per CPU, with a warning (as IPEX does)."""
    if isinstance(num_streams, str):
        if num_streams.lower() != AUTO:
            raise ValueError(f"num_streams must be 'auto' or a positive int, got {num_streams!r}")
        return auto_streams(pool)
    count = as_index(num_streams)
    if count is None or count < 1:
        raise ValueError(f"num_streams must be 'auto' or a positive int, got {num_streams!r}")
    num_streams = count
    if num_streams > len(pool):
        warnings.warn(
            f"num_streams={num_streams} but the pool has {len(pool)} CPUs: using {len(pool)} streams",
            RuntimeWarning,
            stacklevel=3,
        )
        return len(pool)
    return num_streams


class MultiStreamModule(nn.Module):
    """Run ``model`` on ``num_streams`` pinned streams, splitting each call's batch between them.

    ``cpu_pool`` (default ``CPUPool()``) is split into ``num_streams`` contiguous parts
    (``"auto"``/``"AUTO"``: one stream per CPU). ``input_split_hint`` (a :class:`StreamHint`,
    alias ``MultiStreamModuleHint``) gives the batch dimension of each argument (default 0 for
    every tensor); ``output_concat_hint`` the dimension to concatenate each output tensor along
    (default 0; a structure of hints, or a StreamHint as IPEX writes it), ``None`` to keep
    stream 0's value. A batch smaller than the number
    of streams uses only that many streams; uneven batches give the first streams one more item.
    With ``concat_output=False`` the call returns the list of per-stream outputs.
    """

    def __init__(
        self,
        model: Any,
        num_streams: Union[int, str] = AUTO,
        cpu_pool: Optional[CPUPool] = None,
        concat_output: bool = True,
        input_split_hint: Optional[StreamHint] = None,
        output_concat_hint: Any = 0,
    ) -> None:
        super().__init__()
        if not callable(model):
            raise TypeError(f"model must be a module or callable, got {type(model).__name__}")
        if not isinstance(concat_output, bool):
            raise TypeError(f"concat_output must be True or False, not {concat_output!r}")
        pool = cpu_pool if cpu_pool is not None else CPUPool()
        if not isinstance(pool, CPUPool):
            raise TypeError(f"cpu_pool must be a CPUPool, got {type(pool).__name__}")
        num_streams = stream_count(num_streams, pool)
        if input_split_hint is not None and not isinstance(input_split_hint, StreamHint):
            raise TypeError("input_split_hint must be a StreamHint (MultiStreamModuleHint), e.g. StreamHint(0, mask=None)")
        self.model = model
        self.num_streams = num_streams
        self.cpu_pool = pool
        self.concat_output = concat_output
        self.input_split_hint = checked_hint(input_split_hint, "input_split_hint") if input_split_hint is not None \
            else StreamHint()
        self.output_concat_hint = output_concat_hint
        self._output_hint = output_hint(checked_hint(output_concat_hint, "output_concat_hint"))
        self.stream_pools = pool.split(num_streams)
        self._tasks: list[Task] = []
        try:
            for stream_pool in self.stream_pools:
                self._tasks.append(Task(model, stream_pool))
        except BaseException:
            self.close()
            raise

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._tasks:
            raise RuntimeError("MultiStreamModule is closed")
        sizes = slice_sizes(common_batch(args, kwargs, self.input_split_hint), self.num_streams)
        calls = split_call(args, kwargs, self.input_split_hint, sizes)
        futures = [task(*a, **k) for task, (a, k) in zip(self._tasks, calls)]
        wait(futures)
        outputs = [f.result() for f in futures]
        if not self.concat_output:
            return outputs
        return join_outputs(outputs, self._output_hint)

    def close(self, cancel_queued: bool = False) -> None:
        """Finish queued calls (``cancel_queued``: cancel those not yet started), stop and join
        every stream's thread (idempotent). Interrupted (Ctrl-C), the queued calls are cancelled."""
        tasks, self._tasks = self._tasks, []
        try:
            for task in tasks:
                task.close(cancel_queued)
        except KeyboardInterrupt:
            for task in tasks:
                task._inbox.close()
                task._inbox.cancel_queued()
            raise

    @property
    def closed(self) -> bool:
        return not self._tasks

    def get_stream_number(self) -> int:
        """The number of streams (IPEX's name)."""
        return self.num_streams

    def __enter__(self) -> MultiStreamModule:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(cancel_queued=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))

    def extra_repr(self) -> str:
        pools = ", ".join(repr(p) for p in self.stream_pools)
        return f"num_streams={self.num_streams}, streams=[{pools}]"


__all__ = ["MultiStreamModule", "MultiStreamModuleHint", "StreamHint", "auto_streams", "get_default_num_streams"]
