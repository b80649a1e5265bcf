"""Graph freezing: weights become constants of a compiled graph (prepacked for oneDNN / the
inductor cpp backend), with stock torch only.

Two backends:
  * ``inductor``: ``torch.compile(model, options={"freezing": True})``; constant-folds the weights
    (including bf16 casts and conv weight layouts) and generates C++ kernels with gcc. Compiles on
    the first call (at ``optimize`` time when a sample input is given). Slow to compile (~5-15 s for
    a small CNN on 2 cores); a new input shape recompiles.
  * ``jit`` (default): ``torch.jit.trace`` + ``torch.jit.freeze``; needs a sample input; compiles
    in about a second; the graph is specialised to the traced control flow.

Which one wins was measured by ``bench/optimize.py`` (see docs/kernels.md).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

from xlaunch._torch import needs_torch
from xlaunch.kernels.optimize.text import excerpt

with needs_torch(__name__):
    import torch
    from torch import nn

BACKENDS = ("inductor", "jit")


class UnsafeTrace(RuntimeError):
    """Tracing warned that the graph depends on this input's values (TracerWarning)."""


def as_args(sample_input: Any) -> tuple:
    return sample_input if isinstance(sample_input, tuple) else (sample_input,)


def freeze_inductor(model: nn.Module) -> nn.Module:
    """``torch.compile`` with inductor freezing; compiled lazily on the first call."""
    return torch.compile(model, backend="inductor", options={"freezing": True})


@contextlib.contextmanager
def _jit_records_autocast() -> Iterator[None]:
    """Let tracing record autocast's casts as ordinary ops (the JIT autocast pass stays off)."""
    previous = torch._C._jit_set_autocast_mode(False)
    try:
        yield
    finally:
        torch._C._jit_set_autocast_mode(previous)


def freeze_jit(model: nn.Module, sample_input: Any) -> nn.Module:
    """Trace with ``sample_input`` and freeze (weights become constants, convs prepacked).

    oneDNN graph fusion (``torch.jit.enable_onednn_fusion``) is left as the user set it: here it
    gained under 10% on the examples CNN and failed ("partition compile failed") on small models
    with reductions, at run time, so it is not worth turning on behind the user's back.
    torch 2.13 marks ``torch.jit.trace``/``freeze`` deprecated; they still work and win here
    (see ``DEFAULT_FREEZE_BACKEND``), so their deprecation notices are not repeated to users."""
    with torch.no_grad(), _jit_records_autocast(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+` is deprecated")
        traced = torch.jit.trace(model, as_args(sample_input), check_trace=False)
        unsafe = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
        if unsafe:   # the trace baked in a Python value taken from a tensor: not valid for other inputs
            raise UnsafeTrace(excerpt(unsafe[0].message))
        frozen = torch.jit.freeze(traced.eval())
        for _ in range(2):  # the profiling executor specialises and fuses on the first runs
            frozen(*as_args(sample_input))
    return frozen


def freeze(model: nn.Module, backend: str, sample_input: Any = None) -> nn.Module:
    """The frozen model; with a sample input, compiled now (so errors surface here)."""
    if backend not in BACKENDS:
        raise ValueError(f"optimize: freeze_backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "jit":
        if sample_input is None:
            raise ValueError("the jit backend needs a sample_input to trace")
        return freeze_jit(model, sample_input)
    compiled = freeze_inductor(model)
    if sample_input is not None:
        with torch.no_grad():
            compiled(*as_args(sample_input))
    return compiled
