"""The ``inductor`` route: ``torch.compile`` with freezing (weights constant-folded, oneDNN
prepacked), compiled once for every batch size.

torch.compile specialises on the first input's shapes: a new batch size recompiles (seconds), and
even a dynamic graph is specialised again for batch 1 (the 0/1 rule). :class:`FrozenDynamicBatch`
marks the batch dimension of its first call's tensors dynamic before compiling, so one graph
serves every batch size but 1; with ``how="unbacked"`` the dimension is marked *unbacked* (no 0/1
specialisation) and one graph serves batch 1 too. INT8 programs (``quantize``,
``load_quantized``) compile unbacked (measured: batches 8, 3, 16, 1 on one compile, same speed);
fp32 graphs with convolutions do not (inductor's fp32 conv lowering asserts strides that an
unbacked batch breaks), so this route compiles dynamic and its build check at batch 1 compiles
that graph at build time. Where an unbacked compile fails, the module is compiled again dynamic.
With ``optimize(dtype=torch.bfloat16)`` a copy of the model with bf16 weights runs under autocast
inside the compiled graph (:class:`.lowp.Autocast`): freezing prepacks the bf16 weights once. Nothing is cached by xlaunch for this route: a cache hit compiles again, with inductor's own
on-disk caches warm.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from typing import Any, Iterator, Sequence

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.optimize.engines import lowp
from xlaunch.kernels.optimize.engines.base import Built, Context, Route
from xlaunch.kernels.optimize.engines.sample import Sample
from xlaunch.kernels.optimize.freeze import InductorUnavailable, inductor_blocker


def _mark(args: tuple, how: str) -> None:
    from torch._dynamo import decorators

    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            if how == "unbacked":
                decorators.mark_unbacked(arg, 0)
            elif arg.shape[0] > 1:   # a size-1 dimension cannot be marked dynamic
                torch._dynamo.mark_dynamic(arg, 0)


@contextlib.contextmanager
def _uncached(unbacked: bool) -> Iterator[None]:
    """Inductor's and AOTAutograd's on-disk graph caches off while compiling an unbacked batch.

    An unbacked compile that fails (a view folding the batch: inductor adds ``batch == 1`` as a
    runtime assert that fails the compile's own guards) can leave its graph in those caches without
    the assert; the next process then compiles "unbacked" from the cache and returns wrong values
    for every batch but 1 (seen with torch 2.13 on a weightless module that folds the batch). Frozen
    INT8 graphs are not cached there anyway (mkldnn constants, freezing), so this costs them nothing.
    """
    if not unbacked:
        yield
        return
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


class NotCompiled(RuntimeError):
    """torch.compile would run the module eagerly (dynamo compiled its forward too often here)."""


class FrozenDynamicBatch:
    """``torch.compile(module)`` whose compiles run with inductor freezing, batch dim dynamic.

    ``quiet`` holds warning-message patterns kept quiet during the first (compiling) call."""

    def __init__(self, module: nn.Module, how: str = "dynamic", quiet: Sequence[str] = ()) -> None:
        self.module = module
        self.how = how
        self.quiet = tuple(quiet)
        self.compiled: Any = None
        self.calls = 0
        self._lock = threading.Lock()

    def _compile_call(self, args: tuple, how: str) -> Any:
        blocker = inductor_blocker()
        if blocker is not None:
            raise InductorUnavailable(blocker)
        self.compiled = torch.compile(self.module)
        marked = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)   # marks stick to tensors
        _mark(marked, how)
        from torch._dynamo import config as dynamo_config
        from torch._dynamo.exc import FailOnRecompileLimitHit
        from torch._dynamo.utils import counters

        captured = counters["stats"]["unique_graphs"]
        with warnings.catch_warnings(), dynamo_config.patch(fail_on_recompile_limit_hit=True):
            for pattern in self.quiet:
                warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
            try:
                out = self.compiled(*marked)
            except FailOnRecompileLimitHit:
                out = None
        if counters["stats"]["unique_graphs"] == captured:   # dynamo ran it eagerly: not an inductor graph
            raise NotCompiled(
                f"torch.compile compiled no graph for {type(self.module).__qualname__}.forward and would run it "
                f"eagerly: dynamo's recompile limit ({dynamo_config.recompile_limit}) for that forward is reached "
                "in this process (every compile of a module of that class counts)")
        return out

    def __call__(self, *args: Any) -> Any:
        import torch._inductor.config as inductor_config

        with torch.no_grad(), inductor_config.patch(freezing=True), _uncached(self.how == "unbacked"):
            if self.compiled is not None:
                self.calls += 1
                return self.compiled(*args)
            with self._lock:
                if self.compiled is None:
                    try:
                        out = self._compile_call(args, self.how)
                    except Exception as error:
                        if self.how == "dynamic" or isinstance(error, (InductorUnavailable, NotCompiled)):
                            raise
                        # forget the failed graph of this module's forward (not the process's others)
                        torch._dynamo.reset_code(type(self.module).forward.__code__)
                        self.how = "dynamic"
                        out = self._compile_call(args, "dynamic")
                    self.calls += 1
                    return out
            return self.compiled(*args)


class InductorRoute(Route):
    name = "inductor"

    def build(self, model: nn.Module, sample: Sample, context: Context) -> Built:
        # A shallow copy (same parameters and submodules): ``model`` gets an EngineForward that
        # calls this runner, and a module whose compiled frame dynamo gives up on (its
        # recompile_limit, reached by a process building many models) runs that module's own
        # forward eagerly; on ``model`` itself that would call the runner again, without end.
        module: nn.Module = copy.copy(model)
        if context.dtype in lowp.LOW:   # a bf16 copy (weights cast), under autocast
            module = lowp.Autocast(copy.deepcopy(model), context.dtype, lowp.dtypes_of(sample.outputs))
        runner = FrozenDynamicBatch(module)
        runner(*sample.args)   # compiles now (tens of seconds for a large model)
        return Built(runner)
