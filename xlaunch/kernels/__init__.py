"""The bundled optimizer library. Imports torch lazily, on first attribute use.

* :mod:`.optimize`: ``optimize()``, model rewrites (folding, layout, precision, frozen graphs)
* :mod:`.optim`: fused optimizers with split-bf16 master weights
* :mod:`.quantize`: INT8 ``quantize``/``load_quantized`` (torchao's PT2E flow)
* :mod:`.inject`: ``xlaunch --auto-optimize``, the optimizer library in an unmodified program
* :mod:`.probe_worker`: ``xlaunch --check-isa --probe``, what each dtype really reaches here
* :mod:`.native_dtypes`: does this CPU compute bf16/fp16 natively (shared by optimize and optim)
"""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_LAZY = {
    "optimize": "xlaunch.kernels.optimize.pipeline",
    "FusedSGD": "xlaunch.kernels.optim.fused",
    "FusedAdagrad": "xlaunch.kernels.optim.fused",
    "FusedAdam": "xlaunch.kernels.optim.fused",
    "FusedAdamW": "xlaunch.kernels.optim.fused",
    "FusedLamb": "xlaunch.kernels.optim.fused",
    "to_fused": "xlaunch.kernels.optim.fused",
    "master_params": "xlaunch.kernels.optim.fused",
    "quantize": "xlaunch.kernels.quantize.api",
    "load_quantized": "xlaunch.kernels.quantize.api",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
