"""The two routes that are torch itself: ``eager`` (the model as given) and ``torch`` (today's
``optimize()`` rewrite: folding, channels-last, a frozen graph behind the module, never slower
than the model as given by its own measurement). They are the baselines ``auto`` keeps unless an
engine wins by a margin. Neither leaves artifacts: on a cache hit the torch route is rebuilt with
what its measurement kept (graph or not), without timing it again."""
from __future__ import annotations

import copy
from typing import Any

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    from torch import nn

from xlaunch.kernels.optimize.engines.base import Built, Context, Route
from xlaunch.kernels.optimize.engines.sample import Sample


class EagerRoute(Route):
    name = "eager"

    def build(self, model: nn.Module, sample: Sample, context: Context) -> Built:
        return Built(model, module=model)


class TorchRoute(Route):
    name = "torch"

    def build(self, model: nn.Module, sample: Sample, context: Context) -> Built:
        optimized = context.torch_optimize(copy.deepcopy(model), dtype=context.dtype, level=context.level,
                                           sample_input=sample.args, progress=False, **context.flags)
        report = getattr(optimized, "_xlaunch_optimize_report", None)
        kept = getattr(report, "kept", None)
        return Built(optimized, module=optimized, state={"kept": kept})

    def load(self, model: nn.Module, sample: Sample, context: Context, files: dict[str, bytes],
             state: dict[str, Any]) -> Built:
        flags = dict(context.flags)
        kept = state.get("kept")
        if kept in ("frozen", "eager", "given"):   # what the first run's measurement chose
            flags.setdefault("measure", False)
            flags.setdefault("weights_prepack", kept == "frozen")
        level = "O0" if kept == "given" else context.level
        optimized = context.torch_optimize(copy.deepcopy(model), dtype=context.dtype, level=level,
                                           sample_input=sample.args, progress=False, **flags)
        return Built(optimized, module=optimized, state={"kept": kept})
