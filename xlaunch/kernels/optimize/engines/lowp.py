"""What a precision means to each route of ``optimize(..., dtype=..., backend="auto")``.

fp32 is the default. With ``dtype=torch.bfloat16`` (or ``torch.float16``) on a CPU that computes it
natively (:func:`xlaunch.kernels.optimize.precision.resolve_dtype`), every route runs the model in
that precision and is checked against fp32 eager with that precision's tolerance
(:data:`xlaunch.kernels.optimize.engines.policy.MAX_REL_ERROR_BY_DTYPE`):

  * ``torch``: today's rewrite with ``dtype`` (low-precision weights, autocast forward);
  * ``inductor``: :class:`Autocast`: a copy of the model with its floating weights in bf16, inputs
    cast, under autocast, compiled with freezing (bf16 weights, prepacked once). Autocast alone is
    not enough: ``nn.TransformerEncoder``'s fused fast path has no autocast rule, and dynamo takes
    it under autocast where eager does not, so the compiled encoder ran fp32 (error 0.0 vs fp32);
  * ``openvino``: ``INFERENCE_PRECISION_HINT`` ``bf16``/``f16`` (fp32 pins ``f32``: OpenVINO's
    default on a CPU with native bf16 is bf16). Where oneDNN may not compute that precision
    natively (:func:`xlaunch.kernels.native_dtypes.isa_flags`, ``ONEDNN_MAX_CPU_ISA`` included) the
    hint is ``f32``, what OpenVINO runs on such a CPU anyway: OpenVINO 2026.4 reads the CPU's own
    flags for the precision and obeys the ceiling in its kernels, so a ``bf16`` hint under
    ``ONEDNN_MAX_CPU_ISA=AVX2`` on a bf16 CPU returned empty outputs (measured on a Zen 5);
  * ``onnxruntime``: skipped. Its CPU provider has no bf16 MatMul or Conv kernel on x86 (measured
    on 1.32: "Could not find an implementation for MatMul(13)"; its bf16 fast-math GEMM is an
    arm64 session option), and its fp16 CPU kernels cover a few operators only.

Outputs keep the dtype eager gives for the caller's inputs under the caller's context:
:class:`FollowEagerDtypes` casts an engine's floating outputs to it.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn
    from torch.utils import _pytree as pytree

LOW = (torch.bfloat16, torch.float16)
OPENVINO_HINTS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
NO_KERNELS = {
    "onnxruntime": "ONNX Runtime's CPU provider has no {name} MatMul/Conv kernels on x86 "
                   "(its bf16 fast-math GEMM is arm64 only)",
}


def name(dtype: Any) -> str:
    """``"float32"``, ``"bfloat16"``, ``"float16"``."""
    return str(dtype or torch.float32).removeprefix("torch.")


def openvino_hint(dtype: Any) -> str:
    """OpenVINO's ``INFERENCE_PRECISION_HINT`` for ``dtype``: ``f32`` for fp32 (pinned) and for a
    low precision that oneDNN may not compute natively here."""
    from xlaunch.kernels import native_dtypes

    dtype = dtype or torch.float32
    unsupported = {torch.bfloat16: native_dtypes.bf16_unsupported_reason,
                   torch.float16: native_dtypes.fp16_unsupported_reason}.get(dtype)
    if unsupported is not None and unsupported(native_dtypes.isa_flags()) is not None:
        return "f32"
    return OPENVINO_HINTS.get(dtype, "f32")


def unsupported(route: str, dtype: Any) -> Optional[str]:
    """Why ``route`` has no ``dtype`` kernels here, or None."""
    if dtype in LOW and route in NO_KERNELS:
        return NO_KERNELS[route].format(name=name(dtype))
    return None


def _float_leaves_to(value: Any, dtypes: list[Optional[torch.dtype]]) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    out = [leaf.to(dtype) if isinstance(leaf, torch.Tensor) and dtype is not None and leaf.dtype != dtype
           and leaf.is_floating_point() else leaf for leaf, dtype in zip(leaves, dtypes)]
    return pytree.tree_unflatten(out, spec)


def dtypes_of(value: Any) -> list[Optional[torch.dtype]]:
    return [leaf.dtype if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else None
            for leaf in pytree.tree_leaves(value)]


class Autocast(nn.Module):
    """``model`` (a copy: its floating parameters and buffers are cast to ``dtype``) called with
    floating inputs cast to ``dtype`` under ``torch.autocast("cpu", dtype)``; floating outputs in
    the dtypes fp32 eager returns (what inductor compiles for the low-precision route)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, output_dtypes: list[Optional[torch.dtype]]) -> None:
        super().__init__()
        self.model = model.to(dtype)
        self.dtype = dtype
        self.output_dtypes = output_dtypes

    def forward(self, *args: Any) -> Any:
        args = tuple(a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        with torch.autocast("cpu", dtype=self.dtype):
            out = self.model(*args)
        return _float_leaves_to(out, self.output_dtypes)


class FollowEagerDtypes:
    """An engine's runner whose floating outputs come back in the dtypes eager gives under the
    caller's autocast context: fp32 without autocast (what the sample's eager outputs hold); under
    ``torch.autocast("cpu", d)`` the dtypes eager returned in that context, learned from one eager
    call the first time a call comes under it (then remembered per autocast dtype)."""

    def __init__(self, runner: Callable[..., Any], eager: Callable[..., Any], plain: list[Optional[torch.dtype]]) -> None:
        self.runner = runner
        self.eager = eager
        self.plain = plain
        self.under: dict[Any, list[Optional[torch.dtype]]] = {}
        self._lock = threading.Lock()

    def _context(self) -> Any:
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None

    def __call__(self, *args: Any) -> Any:
        context = self._context()
        if context is None:
            return _float_leaves_to(self.runner(*args), self.plain)
        dtypes = self.under.get(context)
        if dtypes is None:
            with self._lock, torch.no_grad():
                dtypes = self.under.setdefault(context, dtypes_of(self.eager(*args)))
        with torch.autocast("cpu", enabled=False):
            out = self.runner(*args)
        return _float_leaves_to(out, dtypes)

    def __getattr__(self, attribute: str) -> Any:   # the runner's own attributes (calls, compiled, ...)
        if attribute in ("runner", "eager", "plain", "under", "_lock"):
            raise AttributeError(attribute)
        return getattr(self.runner, attribute)
