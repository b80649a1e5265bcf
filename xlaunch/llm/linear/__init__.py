"""Linear layers with packed weights for :mod:`xlaunch.llm`: :class:`PackedLinear` (``packed``: kinds, quantization,
the layer) over the native layouts of ``layouts`` (xlaunch/llm/csrc/linear.h). Light to import: torch loads
with the first name used."""
from __future__ import annotations

from xlaunch._lazy import lazy_exports

_PACKED = ("KINDS", "GROUPED", "GROUP_SIZES", "FP32_KERNEL_ROWS", "quantize_int8", "quantize_int4", "quantize_int6",
           "quantize", "dequantize", "activation_block", "round_activations", "PackedLinear")
_LAYOUTS = ("BLOCK", "INT4_ZERO", "INT6_ZERO", "NATIVE_PACKERS", "bf16_valued", "pack_bf16", "unpack_bf16", "pack_int8",
            "unpack_int8", "pack_int4", "unpack_int4", "pack_int6", "unpack_int6", "pack_channels", "unpack_channels")
__getattr__, __dir__ = lazy_exports(__name__, {**{name: "xlaunch.llm.linear.packed" for name in _PACKED},
                                               **{name: "xlaunch.llm.linear.layouts" for name in _LAYOUTS}})
