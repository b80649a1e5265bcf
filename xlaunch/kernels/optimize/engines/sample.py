"""The sample call an engine is built, checked and timed with, and which later calls it may serve.

An engine takes flat tensors and returns flat tensors; the user's model takes positional tensors
(and plain values) and returns a structure (a tensor, tuples, lists, dicts, named tuples).
:class:`Sample` holds the sample's arguments, the eager outputs and their structure
(``torch.utils._pytree``), and which arguments carry the batch: every tensor argument whose
dimension 0 has the first tensor argument's size. Engines are exported with that dimension
dynamic, so one build serves every batch size; a later call is served when it matches the sample
in everything else (:meth:`Sample.accepts`).

What the exporters (ONNX, OpenVINO: both trace with TorchScript) see is :class:`FlatOutputs`
under :func:`tracing_for_export`:
  * ``nn.TransformerEncoder``/``nn.MultiheadAttention`` in eval + no_grad take torch's fused
    fast path (``aten::_transformer_encoder_layer_fwd``), which no exporter converts: the fast
    path is switched off around the export (the exported graph is the same computation);
  * a ``TracerWarning`` raised from the user's code means the trace baked in a value read from a
    tensor (Python control flow on data): the export would be wrong for other inputs, so it is
    refused. The ones torch's own modules raise are not about the user's data.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn
    from torch.utils import _pytree as pytree

from xlaunch.kernels.optimize.compare import flat_tensors
from xlaunch.kernels.optimize.freeze import BufferState, fresh, from_torch
from xlaunch.kernels.optimize.notes import SampleInputError
from xlaunch.kernels.optimize.notes import excerpt


class Unsupported(ValueError):
    """The sample call cannot be served by an exported engine; the message says why."""


def as_args(sample_input: Any) -> tuple:
    return sample_input if isinstance(sample_input, tuple) else (sample_input,)


def _arg_spec(arg: Any, batched: bool) -> tuple:
    if isinstance(arg, torch.Tensor):
        shape = tuple(arg.shape[1:]) if batched else tuple(arg.shape)
        return ("T", arg.dtype, arg.dim(), shape, batched)
    return ("V", type(arg).__name__, repr(arg))


class Sample:
    """One sample call: its arguments, the eager outputs, and what later calls must match."""

    def __init__(self, model: nn.Module, sample_input: Any) -> None:
        args = as_args(sample_input)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            raise Unsupported("the sample input holds no tensor")
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if arg.device.type != "cpu":
                    raise Unsupported(f"a {arg.device.type} tensor in the sample input (engines here run on the CPU)")
                if arg.requires_grad:
                    raise Unsupported("a sample input requires grad (engines serve inference only)")
                if arg.is_sparse or arg.is_quantized or arg.is_nested:
                    raise Unsupported("a sparse, quantized or nested tensor in the sample input")
            elif not (arg is None or isinstance(arg, (bool, int, float, str))):
                raise Unsupported(f"a {type(arg).__name__} argument (engines take tensors and plain values)")
        self._args = fresh(args)   # the caller's tensors are never run (a forward may change its input)
        first = tensors[0]
        self.batch = int(first.shape[0]) if first.dim() > 0 else None
        self.batched = tuple(isinstance(a, torch.Tensor) and self.batch is not None and a.dim() > 0
                             and int(a.shape[0]) == self.batch for a in args)
        self.spec = tuple(_arg_spec(a, b) for a, b in zip(args, self.batched))
        self.tensor_positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self._tensor_checks = [(i, args[i].dtype, self.spec[i][3], self.batched[i]) for i in self.tensor_positions]
        self._plain_checks = [(i, self.spec[i]) for i in range(len(args)) if i not in self.tensor_positions]
        state = BufferState(model)
        try:
            with torch.no_grad():
                self.outputs = model(*self.args)
        except Exception as exc:   # the caller's sample, not an engine's problem
            raise SampleInputError(exc) from exc
        updated = state.changed(model)
        state.restore(model)
        if updated:
            raise Unsupported(f"the forward updates its buffers ({', '.join(updated[:3])}{', ...' if len(updated) > 3 else ''}) "
                              "in place: an exported engine would keep none of that state")
        leaves, self.treespec = pytree.tree_flatten(self.outputs)
        if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise Unsupported("the model's outputs are not all tensors (engines return tensors)")
        self.output_count = len(leaves)

    @property
    def args(self) -> tuple:
        """The sample's arguments: fresh copies on each access (:func:`..freeze.fresh`), so every
        build, check and timing sees the sample as it was, whatever an earlier run did to its input."""
        return fresh(self._args)

    # -- what later calls may be served ----------------------------------------------------------
    def accepts(self, args: tuple) -> bool:
        """Whether ``args`` match the sample except for the batch size (checked on every call:
        kept cheap)."""
        if len(args) != len(self._args):
            return False
        for position, dtype, shape, batched in self._tensor_checks:
            arg = args[position]
            if not isinstance(arg, torch.Tensor) or arg.dtype != dtype or arg.requires_grad or not arg.is_cpu:
                return False
            size = arg.shape
            if batched:
                if len(size) != len(shape) + 1 or size[1:] != shape:
                    return False
            elif size != shape:
                return False
        for position, spec in self._plain_checks:
            if _arg_spec(args[position], False) != spec:
                return False
        return True

    def tensors(self, args: tuple) -> list[torch.Tensor]:
        """The tensor arguments of a call, in order (what an exported engine takes)."""
        return [args[i] for i in self.tensor_positions]

    def structure(self, flat: list[torch.Tensor]) -> Any:
        """Engine outputs (flat, in the eager order) in the structure the model returns."""
        return pytree.tree_unflatten(list(flat), self.treespec)

    def other_batch(self) -> Optional[tuple]:
        """The sample at another batch size (1, or 2 when the sample's is 1): a check that an
        engine really serves every batch size. None when no argument carries a batch."""
        if self.batch is None or not any(self.batched):
            return None
        if self.batch > 1:
            return tuple(a[:1].clone() if b else a for a, b in zip(self._args, self.batched))
        return tuple(torch.cat([a, a]) if b else a for a, b in zip(self._args, self.batched))

    def describe(self) -> str:
        parts = []
        for arg, batched in zip(self._args, self.batched):
            if isinstance(arg, torch.Tensor):
                dims = ["N" if batched and i == 0 else str(n) for i, n in enumerate(arg.shape)]
                parts.append(f"{str(arg.dtype).removeprefix('torch.')}[{','.join(dims)}]")
            else:
                parts.append(repr(arg))
        return "(" + ", ".join(parts) + ")"


class FlatOutputs(nn.Module):
    """The model with only its tensor arguments as inputs (plain values bound to the sample's)
    and its outputs flattened to a tuple: what the ONNX and OpenVINO exporters trace."""

    def __init__(self, model: nn.Module, sample: Sample) -> None:
        super().__init__()
        self.model = model
        self._args = sample.args
        self._positions = sample.tensor_positions

    def forward(self, *tensors: torch.Tensor) -> tuple:
        args = list(self._args)
        for position, tensor in zip(self._positions, tensors):
            args[position] = tensor
        return tuple(flat_tensors_in_order(self.model(*args)))


def flat_tensors_in_order(value: Any) -> list[torch.Tensor]:
    """The output tensors in ``torch.utils._pytree`` order (what :meth:`Sample.structure` expects)."""
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def max_relative_error(reference: Any, candidate: Any) -> float:
    """``max |candidate - reference| / max |reference|`` over every floating output (inf when the
    structures differ or a value is NaN; integer outputs must be equal)."""
    refs, cands = flat_tensors(reference), flat_tensors(candidate)
    if len(refs) != len(cands):
        return float("inf")
    worst = 0.0
    for ref, cand in zip(refs, cands):
        if not isinstance(cand, torch.Tensor) or ref.shape != cand.shape:
            return float("inf")
        if not ref.is_floating_point():
            if not torch.equal(ref, cand.to(ref.dtype)):
                return float("inf")
            continue
        if ref.numel() == 0:
            continue
        r32, c32 = ref.detach().float(), cand.detach().float()
        error = (r32 - c32).abs().max().item() / max(r32.abs().max().item(), 1e-12)
        worst = max(worst, error if error == error else float("inf"))
    return worst


class UnsafeTrace(RuntimeError):
    """The trace depends on input values (a TracerWarning from the model's own code)."""


@contextlib.contextmanager
def tracing_for_export() -> Iterator[None]:
    """no_grad, the fused attention fast path off, exporter noise kept quiet, and a TracerWarning
    from outside torch turned into :class:`UnsafeTrace`."""
    mha = getattr(torch.backends, "mha", None)
    previous = mha.get_fastpath_enabled() if mha is not None else None
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mha is not None:
            mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            if mha is not None:
                mha.set_fastpath_enabled(previous)
    for warning in caught:
        if issubclass(warning.category, torch.jit.TracerWarning) and not from_torch(warning.filename):
            where = f"{os.path.basename(str(warning.filename))}:{warning.lineno}"
            raise UnsafeTrace(f"the trace depends on input values (Python control flow on a tensor at {where}: "
                              f"{excerpt(warning.message)})")
