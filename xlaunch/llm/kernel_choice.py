"""Measured kernel choice: a packed linear's rows by xlaunch's kernel, or from a measured row count on
by ATen's dense GEMM.

ATen's ``F.linear`` runs oneDNN's or MKL's GEMM, which outruns the packed kernels once enough rows
share each weight (a long prompt's prefill, a large batch): in bf16 where the CPU has native bf16
(AVX512_BF16; AMX tiles on an AMX CPU), in fp32 elsewhere. The dense route widens the packed weight to
a dense ``[N, K]`` tensor in that dtype (into a buffer per thread, kept for the next call:
:func:`reused_buffer`) and lets ATen multiply. A measurement the kernels win at every count drops that
buffer again: a process whose answers are all "never" keeps no widened weight (up to 32 MiB of bf16,
:data:`xlaunch.llm.footprint.WIDEN_SLICE_BYTES`, per thread that measured).

Which route runs is measured, never assumed. The first time a layer of a shape (weights kind, N, K,
group size, activation dtype, threads) sees :data:`PROBE_ROWS`\\[0] rows or more, both routes are
timed, from the largest probe count whose work stays under :data:`PROBE_MACS` downwards, while the
dense route wins: the shape's threshold is the smallest count it won at (None: it lost at the largest,
and the kernels run at every count). Thresholds are kept per process and in a small JSON file per
machine fingerprint (CPU, kernel build, torch), so a later process does not measure again.

Only a CPU with native bf16 measures: elsewhere the dense route multiplies in fp32 after widening the
weight, which measured 0.04-0.80x of the kernels' speed on the AVX2 VM (1B shapes' linears, 32-512
rows), so the kernels run there without a measurement.

``XLAUNCH_LLM_DENSE_ROWS``: ``auto`` (the default: measured where the CPU has native bf16, else the
kernels), ``off`` (the kernels always), or a row count (the dense route from that many rows on,
unmeasured, on any CPU).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Union

from xlaunch import userfiles
from xlaunch._native_build import cache_root
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

from xlaunch.llm import footprint, native  # noqa: E402

ENV = "XLAUNCH_LLM_DENSE_ROWS"
PROBE_ROWS = (16, 32, 64, 128, 256, 512)
PROBE_MACS = 1 << 34             # the largest probe: rows x N x K under this (a 128k x 2048 lm_head: 64 rows)
REPEATS = 3
CACHE_LIMIT = 1 << 20            # the cache file: a few hundred bytes per shape
CACHE_SUBDIR = "llm-choice"

Linear = Callable[["torch.Tensor"], "torch.Tensor"]
Dense = Callable[["torch.Tensor", "torch.dtype"], "torch.Tensor"]
Timer = Callable[[Linear, "torch.Tensor"], float]

_lock = threading.Lock()
_known: dict[str, dict[str, Optional[int]]] = {}   # kernel level -> shape key -> threshold (None: never)
_loaded: set[str] = set()                          # levels whose cache file was read into _known


def mode() -> Union[str, int]:
    """``"auto"``, ``"off"`` or a forced row count, from ``$XLAUNCH_LLM_DENSE_ROWS``; ValueError on a bad value."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value in ("auto", "off"):
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"{ENV}={value!r}: expected auto, off or a positive row count")


def shape_key(kind: str, n: int, k: int, group_size: int, dtype: "torch.dtype", threads: int) -> str:
    return f"{kind}:{n}x{k}:g{group_size if kind in footprint.GROUPED else 0}:{str(dtype).removeprefix('torch.')}:t{threads}"


@functools.lru_cache(maxsize=None)
def fingerprint(level: str) -> str:
    """What a measurement holds for: the CPU (model and flags), the kernels' ``level`` and its build, torch."""
    from xlaunch.machine import current_machine

    isa = current_machine().isa
    text = "\0".join([isa.model_name or "", " ".join(sorted(isa.flags)), level, native.LIBRARY.build_key(level),
                      torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_file(level: str) -> Path:
    """The cache of the thresholds measured with ``level``'s kernels on this machine."""
    return cache_root() / CACHE_SUBDIR / f"{fingerprint(level)}.json"


def _read_cache(path: Path) -> dict[str, Optional[int]]:
    """The thresholds in ``path``; {} when it is missing, unreadable, oversized, special or malformed."""
    try:
        data = json.loads(userfiles.read_user_file(str(path), limit=CACHE_LIMIT))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: value for key, value in data.items()
            if isinstance(key, str) and (value is None or (type(value) is int and value > 0))}   # not JSON true


def _write_cache(path: Path, known: dict[str, Optional[int]]) -> None:
    """Merge ``known`` into ``path`` (atomically); a read-only or full disk only costs the next process a measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent.is_symlink():
            return
        merged = {**_read_cache(path), **known}
        userfiles.write_atomically(str(path), json.dumps(merged, indent=1, sort_keys=True).encode())
    except (OSError, ValueError):
        pass


_widening = threading.local()


def reused_buffer(n: int, k: int, dtype: "torch.dtype") -> "torch.Tensor":
    """This thread's ``[n, k]`` buffer of ``dtype`` for a widened weight: one per thread and dtype, grown to the
    largest asked and kept (the dense route asks for at most a 32 MiB slice). A fresh tensor each call would cost
    more in first-touch page faults than the widening itself (a new 32 MiB took 37 ms to fill on the AVX2
    VM, one thread; a reused one is written at memory speed)."""
    buffers = _widening.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < n * k:
        buffer = buffers[dtype] = torch.empty(n * k, dtype=dtype)
    return buffer[:n * k].view(n, k)


def release_reused_buffers() -> None:
    """Drop this thread's widening buffers (the next dense call allocates again)."""
    _widening.__dict__.pop("buffers", None)


def median_seconds(fn: Linear, x: "torch.Tensor") -> float:
    """Median wall time of ``fn(x)`` over :data:`REPEATS` calls, after one untimed call."""
    fn(x)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_rows(n: int, k: int) -> tuple[int, ...]:
    """The row counts probed for an ``[n, k]`` weight: those whose work stays under :data:`PROBE_MACS`."""
    return tuple(rows for rows in PROBE_ROWS if rows * n * k <= PROBE_MACS) or PROBE_ROWS[:1]


def measure(kernel: Linear, dense: Linear, n: int, k: int, dtype: "torch.dtype",
            timer: Timer = median_seconds) -> Optional[int]:
    """The smallest probe count from which ``dense`` beats ``kernel``, going down from the largest while it
    wins (its lead only grows with the rows: the widening is paid once per call); None when it loses there."""
    generator = torch.Generator().manual_seed(0)
    found = None
    for count in reversed(probe_rows(n, k)):
        x = torch.randn(count, k, generator=generator).to(dtype)
        if timer(dense, x) >= timer(kernel, x):
            break
        found = count
    return found


def threshold(level: str, key: str, kernel: Linear, dense: Linear, n: int, k: int,
              dtype: "torch.dtype") -> Optional[int]:
    """The measured row threshold of the dense route for ``key`` with ``level``'s kernels: known in this
    process, cached on disk, or measured now."""
    known = _known.setdefault(level, {})
    if key in known:
        return known[key]
    with _lock:
        if key in known:
            return known[key]
        path = cache_file(level)
        if level not in _loaded:
            known.update(_read_cache(path))
            _loaded.add(level)
            if key in known:
                return known[key]
        print(f"xlaunch.llm: timing the {level} kernel against ATen's GEMM for {key} (once on this machine)",
              file=sys.stderr, flush=True)
        found = measure(kernel, dense, n, k, dtype)
        if found is None:          # the dense route will not run for this shape: keep no widened weight for it
            release_reused_buffers()
        known[key] = found
        _write_cache(path, {key: found})
        return found


def routed(level: str, kind: str, n: int, k: int, group_size: int, kernel: Linear, dense: Dense) -> Linear:
    """For ``kernel`` of ``level``: a function sending calls of enough rows to ``dense`` (given the dtype to
    multiply in: bf16 for bf16 activations where the CPU has native bf16, else fp32) once the forced or
    measured threshold says so, the others to ``kernel``; ``kernel`` itself when nothing is to choose (no
    extra call): the choice is off, or automatic on a CPU without native bf16. ``$XLAUNCH_LLM_DENSE_ROWS``
    is read here, once per binding."""
    current = mode()
    bf16_native = footprint.native_bf16()
    if current == "off" or (current == "auto" and not bf16_native):
        return kernel
    least = current if isinstance(current, int) else PROBE_ROWS[0]

    def by_gemm(x: "torch.Tensor") -> "torch.Tensor":
        return dense(x, torch.bfloat16 if x.dtype == torch.bfloat16 and bf16_native else torch.float32)

    def linear(x: "torch.Tensor") -> "torch.Tensor":
        count = x.numel() // k
        if count >= least:
            if current == "auto":
                key = shape_key(kind, n, k, group_size, x.dtype, torch.get_num_threads())
                rows = threshold(level, key, kernel, by_gemm, n, k, x.dtype)
                if rows is None or count < rows:
                    return kernel(x)
            return by_gemm(x)
        return kernel(x)

    return linear


def thresholds() -> dict[str, dict[str, Optional[int]]]:
    """What this process uses: per kernel level, each shape key's row threshold (None: the kernels always)."""
    with _lock:
        return {level: dict(known) for level, known in _known.items() if known}


def forget() -> None:
    """Drop what this process measured or read (tests; a changed thread count keys itself)."""
    with _lock:
        _known.clear()
        _loaded.clear()
