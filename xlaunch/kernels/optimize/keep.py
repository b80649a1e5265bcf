"""The last steps of :func:`.pipeline.optimize` on a sample input: freezing a graph for it, and
keeping the fastest of the model as given, the eager rewrite and the frozen graph (``measure``).
``report`` is the pipeline's ``Report`` (not imported: the pipeline imports this module)."""
from __future__ import annotations

from typing import Any, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize import dispatch, fold, freeze, layout, measure
from xlaunch.kernels.optimize.notes import info
from xlaunch.kernels.optimize.notes import record_warning as _warn


def freeze_for_sample(model: nn.Module, forward: dispatch.OptimizedForward, sample_input: Any,
                      report: Any) -> None:
    """Build ``forward``'s frozen graph for the sample input now (or say why it cannot be)."""
    args = freeze.as_args(sample_input)
    if dispatch.signature(args) is None:
        _warn(report, "sample_input holds arguments a traced graph cannot take (only tensors and plain "
                      "values are); not frozen for it")
        return
    with torch.no_grad():
        forward.graph_for(args)


def keep_the_fastest(given: nn.Module, model: nn.Module, forward: Optional[dispatch.OptimizedForward],
                     log: fold.FoldLog, sample_input: Any, report: Any) -> None:
    """Time the model as given, the eager rewrite and the frozen graph on the sample input; keep
    the most optimized variant that is not measurably slower than the fastest."""
    args = freeze.fresh(freeze.as_args(sample_input))
    sig = dispatch.signature(args)
    graph = forward.frozen.get(sig) if forward is not None and sig is not None else None
    eager = forward.eager if forward is not None else model.forward
    variants = {"given": lambda: given(*args), "eager": lambda: eager(*args)}
    if graph is not None:
        variants["frozen"] = lambda: graph(*args)
    with torch.no_grad():
        timings = measure.interleaved(variants)
    report.timings_ms = {name: value * 1e3 for name, value in timings.medians().items()}
    kept = measure.choose(timings, ["frozen", "eager", "given"])
    report.kept = kept
    speed = ", ".join(f"{name} {1 / timings.ratio(name, 'given'):.2f}x" for name in timings.samples)
    if kept == "frozen":
        info(f"kept the frozen graph (speed vs the model as given: {speed})")
        return
    if forward is not None:
        forward.prefer_eager = True
        forward.frozen = {key: None for key in forward.frozen}
    if kept == "given":
        fold.undo(model, log)
        layout.to_contiguous(model)
        report.folded, report.dropouts_removed, report.channels_last_convs = [], [], 0
        if forward is not None:
            forward.freeze_backend = None
    report.frozen_with = None
    if kept == "eager":   # the rewrites are kept; only the graph is left out: as planned, not a warning
        info(f"kept the eager rewrite, not frozen: on the sample input it measured fastest (speed vs "
             f"the model as given: {speed})")
        return
    _warn(report, f"kept the model as given (rewrites undone): on the sample input it measured fastest "
                  f"(speed vs the model as given: {speed})")
