"""INT8 ``quantize``/``load_quantized`` through torchao's PT2E flow: the entry and report
(:mod:`.api`, :mod:`.result`, :mod:`.inputs`), how each route is built (:mod:`.routes`,
:mod:`.rewrites`, :mod:`.capture`), which routes suit this CPU (:mod:`.policy`)."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports, make_callable

_LAZY = {
    "quantize": "xlaunch.kernels.quantize.api",
    "load_quantized": "xlaunch.kernels.quantize.api",
    "QuantizeReport": "xlaunch.kernels.quantize.api",
    "QuantizedModule": "xlaunch.kernels.quantize.api",
    "QuantizeWarning": "xlaunch.kernels.quantize.routes",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
make_callable(__name__, "quantize", "xlaunch.kernels.quantize.api")
