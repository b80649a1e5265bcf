"""``optimize()``: rewrites that keep results (folding, channels-last, bf16, frozen graphs behind
the module), chosen by measurement. :mod:`.pipeline` is the entry; the other modules are its steps;
:mod:`.engines` measures ONNX Runtime, OpenVINO and inductor against it (``backend="auto"``)."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports, make_callable

_LAZY = {
    "optimize": "xlaunch.kernels.optimize.pipeline",
    "Options": "xlaunch.kernels.optimize.pipeline",
    "Report": "xlaunch.kernels.optimize.pipeline",
    "EngineReport": "xlaunch.kernels.optimize.engines.report",
    "OptimizeWarning": "xlaunch.kernels.optimize.notes",
    "outputs_close": "xlaunch.kernels.optimize.compare",
    "save_optimized": "xlaunch.kernels.optimize.engines.saved",
    "load_optimized": "xlaunch.kernels.optimize.engines.saved",
    "SavedModelError": "xlaunch.kernels.optimize.engines.saved",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
make_callable(__name__, "optimize", "xlaunch.kernels.optimize.pipeline")
