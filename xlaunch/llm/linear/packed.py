"""Linear layers with packed weights: bf16, fp32, weight-only INT8 (per output channel), INT4 and INT6 (group-wise).

:class:`PackedLinear` holds one weight in the layout its kernel reads and computes
``y = x @ W.T + b`` in the activation dtype (fp32 accumulation). Several ``nn.Linear`` of one input
(q, k and v; gate and up) can be packed into one, so one call reads all their weights.

Quantization (round to nearest):
* ``int8``: symmetric per output channel, ``scale[n] = max|W[n, :]| / 127``, ``q = round(W / scale)``.
* ``int4``: symmetric per group of ``group_size`` inputs, ``scale[n, g] = max|W[n, g]| / 7``,
  ``q = clamp(round(W / scale), -8, 7)``.
* ``int6``: as int4 with ``max|W[n, g]| / 31`` and ``q`` in [-32, 31]: the INT4 route's lm_head (llama.cpp
  keeps its output layer at 6 bits, Q6_K, under Q4_0), native layout only.

Layouts (``PackedLinear.layout``), chosen once when the layer is built: ``"native"``, blocks of 64 output
channels for ``torch.ops.xlaunch_llm`` (csrc/linear.h) when the kernels are loaded (:func:`native.ops`; an fp32
weight too when its values are all bf16 values, a bf16 checkpoint's: stored as bf16, multiplied in fp32); else
``"aten"``, ATen's own CPU kernels' layouts: ``F.linear`` (fp32, bf16), ``torch._weight_int8pack_mm`` (int8),
``aten._weight_int4pack_mm_for_cpu`` (int4, nibbles ``q + 8``, zero points 0); int6 (no ATen kernel) as int8.
Both compute the same products (the quantized integers times fp32 scales) up to fp rounding; the native INT4
and INT6 kernels at the baseline level round fp32 activations to bf16 (INT8 keeps them fp32). A native layer
asked to run without the kernels (``prefer_native(False)``) dequantizes and multiplies (slow).

Where the kernels run integer dot products (every level but baseline: AVX2's ``vpmaddubsw``, AVX-512 VNNI's
``vpdpbusd``; :func:`activation_block` 32), INT8, INT4 and INT6 layers first round each activation row per
block of 32 values to ``q * d`` (``d = max|x| / 127``, ``q = round(x / d)``, as llama.cpp's Q8_0):
:func:`round_activations` is that rounding, prefill included (at the baseline level an INT8 prefill of 8 rows
or more widens each block to bf16 instead, exact).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from xlaunch._errors import as_index
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.llm import footprint, kernel_choice, native  # noqa: E402
from xlaunch.llm.linear.layouts import (BLOCK, INT4_ZERO, NATIVE_PACKERS, _int6_rows, _native_rows,  # noqa: E402
                                        _pad_rows, bf16_valued, pack_bf16, pack_channels, unpack_bf16,
                                        unpack_channels, unpack_int4, unpack_int6, unpack_int8)

KINDS = ("fp32", "bf16", "int8", "int4", "int6")
GROUPED = footprint.GROUPED   # the kinds quantized per group of ``group_size`` inputs
GROUP_SIZES = (32, 64, 128)
FP32_KERNEL_ROWS = 4  # fp32 weights: up to this many rows by the kernels' fp32_linear, more by ATen's GEMM


def quantize_int8(weight: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(int8 [N, K], fp32 scales [N]) of a float weight, symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: "torch.Tensor", group_size: int, bits: int = 4) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(int8 values in [-8, 7] of shape [N, K], fp32 scales [N, K // group_size]), symmetric per group; ``bits``
    6: values in [-32, 31] (int6)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the INT{bits} group size {group_size}")
    top = (1 << (bits - 1)) - 1
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    scale = w.abs().amax(dim=2).clamp(min=1e-12) / float(top)
    q = torch.round(w / scale[:, :, None]).clamp(-top - 1, top).to(torch.int8)
    return q.reshape(n, k), scale


def quantize_int6(weight: "torch.Tensor", group_size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    return quantize_int4(weight, group_size, bits=6)      # values in [-32, 31]


def quantize(kind: str, weight: "torch.Tensor", group_size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(values, scales) of ``weight`` quantized as ``kind`` ("int8", "int4" or "int6"; the last two per group)."""
    return quantize_int8(weight) if kind == "int8" else quantize_int4(weight, group_size, 6 if kind == "int6" else 4)


def dequantize(q: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    """The fp32 weight a quantized one stands for (scales per row, or per row and group)."""
    n, k = q.shape
    groups = scale.reshape(n, -1).shape[1]
    return (q.float().reshape(n, groups, k // groups) * scale.reshape(n, groups, 1)).reshape(n, k)


def activation_block() -> int:
    """32 when the loaded kernels' INT8/INT4 layers quantize activations per row in blocks of 32 values
    (integer dot products: every level but baseline), 0 when they take them as they are (or no kernels are
    loaded)."""
    ops = native.ops()
    if ops is None or not hasattr(ops, "linear_activation_block"):
        return 0
    return int(ops.linear_activation_block())


def round_activations(x: "torch.Tensor", block: int = 32) -> "torch.Tensor":
    """fp32 ``x`` [..., K] as the integer kernels see it: per block of ``block`` values along K,
    ``q * d`` with ``d = max|x| / 127`` and ``q = round(x * (127 / max|x|))`` (half to even)."""
    x = x.float()
    k = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -k % block)).reshape(*x.shape[:-1], -1, block)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    rounded = torch.round(padded * inverse) * (amax / 127.0)
    return rounded.reshape(*x.shape[:-1], -1)[..., :k]


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W packed as ``kind``; inference only (no autograd)."""

    def __init__(self, weight: "torch.Tensor", bias: Optional["torch.Tensor"], kind: str,
                 dtype: "torch.dtype" = torch.bfloat16, group_size: int = 128) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"weights must be one of {', '.join(KINDS)}, not {kind!r}")
        if kind in GROUPED and as_index(group_size) not in GROUP_SIZES:     # not 64.0: a reshape failed on it
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, not {group_size!r}")
        if weight.dim() != 2:
            raise ValueError(f"the weight must be 2-D [out_features, in_features], not {tuple(weight.shape)}")
        self.kind, self.dtype, self.group_size = kind, dtype, group_size
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())
        self.layout = "native" if native.ops() is not None and (kind != "fp32" or bf16_valued(weight)) else "aten"
        with torch.no_grad():
            self._pack(weight.detach())

    def _pack(self, weight: "torch.Tensor") -> None:
        weight_buf, scales = None, None
        if self.kind == "fp32" and self.layout == "aten":
            weight_buf = weight.float().contiguous()
        elif self.kind in ("fp32", "bf16"):
            weight_buf = pack_bf16(weight) if self.layout == "native" else weight.to(torch.bfloat16).contiguous()
        else:
            q, scale = quantize(self.kind, weight, self.group_size)
            if self.layout == "native":
                weight_buf, scales = NATIVE_PACKERS[self.kind](q), pack_channels(scale)
            elif self.kind != "int4":   # int8: ATen's own layout; int6 (no ATen kernel): dequantized to multiply
                weight_buf, scales = q.contiguous(), scale
            else:   # ATen wants N in multiples of 16; padded channels have scale 0
                u = _pad_rows(q.to(torch.int32) + INT4_ZERO, 16, INT4_ZERO)
                weight_buf = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
                s = _pad_rows(scale, 16).t()
                scales = torch.stack([s, torch.zeros_like(s)], dim=-1).contiguous()
        ops = native.ops()
        if ops is not None and hasattr(ops, "huge_page_copy"):   # streamed once per token: 2 MiB pages
            weight_buf = ops.huge_page_copy(weight_buf)
        self.register_buffer("weight", weight_buf)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linears(cls, linears: Sequence["nn.Linear"], kind: str, dtype: "torch.dtype" = torch.bfloat16,
                     group_size: int = 128) -> "PackedLinear":
        """One packed layer computing the outputs of ``linears`` (same input) concatenated."""
        weight = torch.cat([layer.weight.detach() for layer in linears], dim=0)
        biases = [layer.bias for layer in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else torch.zeros(l.out_features, dtype=l.weight.dtype)
                              for b, l in zip(biases, linears)])
        return cls(weight, bias, kind, dtype=dtype, group_size=group_size)

    @classmethod
    def from_packed(cls, weight: "torch.Tensor", scales: Optional["torch.Tensor"], bias: Optional["torch.Tensor"],
                    kind: str, dtype: "torch.dtype", group_size: int, out_features: int, in_features: int,
                    layout: str) -> "PackedLinear":
        """A layer over tensors already packed as :meth:`_pack` lays them out, used as they are (no copy)."""
        if kind not in KINDS or layout not in ("native", "aten"):
            raise ValueError(f"unknown packed layer: weights {kind!r}, layout {layout!r}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.kind, layer.dtype, layer.group_size, layer.layout = kind, dtype, group_size, layout
        layer.out_features, layer.in_features = out_features, in_features
        for name, tensor in (("bias", bias), ("weight", weight), ("scales", scales)):
            layer.register_buffer(name, tensor)
        return layer

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.kind in GROUPED else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, weights={self.kind}, "
                f"dtype={self.dtype}{extra}, bias={self.bias is not None}, layout={self.layout}")

    def quantized(self) -> tuple["torch.Tensor", "torch.Tensor"]:
        """(int8 values [N, K], fp32 scales [N] or [N, K // group_size]) of an int8, int4 or int6 layer."""
        n, k = self.out_features, self.in_features
        if self.kind == "int8":
            if self.layout == "native":
                return unpack_int8(self.weight, n, k), unpack_channels(self.scales, n)
            return self.weight, self.scales
        if self.kind == "int6":
            if self.layout == "native":
                return unpack_int6(self.weight, n), unpack_channels(self.scales, n)
            return self.weight, self.scales
        if self.kind != "int4":
            raise ValueError(f"a {self.kind} layer is not quantized")
        if self.layout == "native":
            return unpack_int4(self.weight, n), unpack_channels(self.scales, n)
        # ATen's int4 packing is opaque: multiply the identity, group by group (exact in fp32).
        scales = self.scales.float()[:, :n, 0].t().contiguous()
        unit = torch.zeros_like(self.scales, dtype=torch.float32)
        unit[..., 0] = 1.0
        values = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k), self.weight, self.group_size, unit)
        return values[:, :n].t().round().to(torch.int8), scales

    def rows(self, ids: "torch.Tensor") -> "torch.Tensor":
        """The rows ``W[ids]``, ``[*ids.shape, K]``: a tied embedding looked up in its packed lm_head. fp32 and
        bf16 rows are the stored values; int8 and int6 rows are dequantized (times their channel's or groups' scales)."""
        flat, k = ids.reshape(-1), self.in_features
        native_layout = self.layout == "native"
        if self.kind == "int8":
            q = _native_rows(self.weight, flat, 4, k) if native_layout else self.weight[flat]
            out = q.float() * self.scales.reshape(-1)[flat].unsqueeze(1)
        elif self.kind == "int6":
            q = _int6_rows(self.weight, flat, k) if native_layout else self.weight[flat]
            scales = self.scales[flat // BLOCK, :, flat % BLOCK] if native_layout else self.scales[flat]
            out = (q.float().reshape(flat.numel(), -1, self.group_size) * scales.float().unsqueeze(2)).reshape(-1, k)
        elif self.kind in ("fp32", "bf16") and native_layout:
            out = _native_rows(self.weight, flat, 2, k).to(self.dtype if self.kind == "fp32" else torch.bfloat16)
        elif self.kind in ("fp32", "bf16"):
            out = self.weight[flat]
        else:
            raise ValueError(f"rows of a {self.kind} layer are not looked up (a tied lm_head is int6 or int8 under int4)")
        return out.reshape(*ids.shape, k)

    def dense_weight(self) -> "torch.Tensor":
        """The weight as an fp32 [N, K] tensor (dequantized)."""
        if self.kind == "fp32" and self.layout == "aten":
            return self.weight
        if self.kind in ("fp32", "bf16"):
            if self.layout == "native":
                return unpack_bf16(self.weight, self.out_features, self.in_features).float()
            return self.weight.float()
        return dequantize(*self.quantized())

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        """``x @ W.T + b`` by the kernels (native layout; fp32 ones up to :data:`FP32_KERNEL_ROWS` rows) or ATen's;
        ``x`` [..., in_features] of a floating-point dtype (a ValueError otherwise: the INT8 kernel read a width
        up to the next multiple of 4 as its own, and integer inputs came back truncated)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 \
                or x.shape[-1] != self.in_features:
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"PackedLinear: the input must be a floating-point [..., {self.in_features}] tensor, "
                             f"not {got}")
        ops = native.ops()
        if self.layout == "native":
            return self._native(ops, x) if ops is not None else self._reference(x)
        if self.kind == "fp32":
            if ops is not None and x.numel() <= FP32_KERNEL_ROWS * self.in_features:
                return ops.fp32_linear(x, self.weight, self.bias).to(x.dtype)
            return self._add_bias(torch.nn.functional.linear(x.float(), self.weight)).to(x.dtype)
        return self._aten(x)

    def bound(self, ops: Optional[object]) -> Callable[["torch.Tensor"], "torch.Tensor"]:
        """A function computing :meth:`forward` for inputs in ``self.dtype``, with the checks done now.

        With the kernels (``ops``, from :func:`xlaunch.llm.native.ops`) and the native layout it is the
        operator with the weights bound, routed by :func:`xlaunch.llm.kernel_choice.routed` (calls of many
        rows to ATen's GEMM where that measured faster); else :meth:`forward`.
        """
        if ops is None or self.layout != "native":
            return self.forward
        weight, scales, bias, n = self.weight, self.scales, self.bias, self.out_features
        if self.kind in ("fp32", "bf16"):     # fp32: bf16-valued weights, fp32 activations multiplied unrounded
            bf16_linear = ops.bf16_linear
            kernel = lambda x: bf16_linear(x, weight, bias, n)   # noqa: E731
        elif self.kind == "int8":
            int8_linear = ops.int8_linear
            kernel = lambda x: int8_linear(x, weight, scales, bias, n)   # noqa: E731
        else:
            nibble_linear, group = ops.int6_linear if self.kind == "int6" else ops.int4_linear, self.group_size
            kernel = lambda x: nibble_linear(x, weight, scales, bias, n, group)   # noqa: E731
        return kernel_choice.routed(str(ops.compiled_isa()), self.kind, n, self.in_features, self.group_size, kernel,
                                    self.dense_forward)

    def widened_weight(self, dtype: "torch.dtype", reuse: bool = False,
                       channels: Optional[tuple[int, int]] = None) -> "torch.Tensor":
        """The weight as a dense ``[N, K]`` tensor in ``dtype``: bf16 weights as stored, int8/int4 ones as their
        integers times their scales (in fp32, rounded once to ``dtype``: :meth:`dense_weight` in ``dtype``).
        ``channels`` (start, end): only those output channels (start a multiple of 64). A native layer is
        widened by the kernels' ``widen_weight_`` (parallel over its blocks); ``reuse``: into this thread's
        :func:`xlaunch.llm.kernel_choice.reused_buffer` (valid until its next widening), else a new tensor."""
        n, k = self.out_features, self.in_features
        start, end = channels or (0, n)
        if start % BLOCK or not 0 <= start < end <= n:
            raise ValueError(f"channels {start}:{end} of {n}: the start must be a multiple of {BLOCK}, within the layer")
        ops = native.ops()
        if self.layout == "native" and dtype in (torch.bfloat16, torch.float32) and hasattr(ops, "widen_weight_"):
            out = kernel_choice.reused_buffer(end - start, k, dtype) if reuse else torch.empty(end - start, k, dtype=dtype)
            blocks = slice(start // BLOCK, (end + BLOCK - 1) // BLOCK)
            scales = None if self.scales is None else self.scales[blocks]
            ops.widen_weight_(out, self.weight[blocks], scales, self.group_size)
            return out
        return self.dense_weight()[start:end].to(dtype)

    def dense_forward(self, x: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
        """``x @ W.T + b`` by ATen's GEMM in ``dtype`` on :meth:`widened_weight`, returned in ``x``'s dtype:
        :mod:`xlaunch.llm.kernel_choice`'s route for many rows. The weight is widened into this thread's
        reused buffer a slice of channels at a time (:func:`xlaunch.llm.footprint.widened_slice_channels`,
        at most 32 MiB: the 1B shape's 128k x 2048 lm_head would take 501 MiB whole), each slice multiplied
        as it is widened."""
        n, k = self.out_features, self.in_features
        act = x.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        step = footprint.widened_slice_channels(n, k, act.element_size())
        parts = []
        for start in range(0, n, step):       # each slice multiplied before the next overwrites the buffer
            weight = self.widened_weight(dtype, reuse=True, channels=(start, min(n, start + step)))
            parts.append(torch.nn.functional.linear(act, weight, None if bias is None else bias[start:start + step]))
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)

    def _native(self, ops: object, x: "torch.Tensor") -> "torch.Tensor":
        """The kernels on ``x`` of any float dtype: bf16 weights take bf16, fp32 (bf16-valued) ones fp32, the
        others bf16 or fp32."""
        if self.kind in ("fp32", "bf16"):
            act = x.to(torch.float32 if self.kind == "fp32" else torch.bfloat16)
        else:
            act = x if x.dtype in (torch.bfloat16, torch.float32) else x.to(self.dtype)
        return self.bound(ops)(act).to(x.dtype)

    def _aten(self, x: "torch.Tensor") -> "torch.Tensor":
        if self.kind == "bf16":
            return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)
        act = x if x.dtype in (torch.bfloat16, torch.float32) else x.to(self.dtype)
        flat = act.reshape(-1, self.in_features)
        if self.kind == "int6":
            y = torch.nn.functional.linear(flat, self.dense_weight().to(flat.dtype))
        elif self.kind == "int8":
            if flat.dtype != torch.float32 and self.in_features % 16:
                flat = flat.float()   # torch 2.13's bf16 kernel reads out of bounds when K % 16 != 0
            y = torch._weight_int8pack_mm(flat, self.weight, self.scales.to(flat.dtype))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group_size,
                                                           self.scales.to(act.dtype))[:, :self.out_features]
        return self._add_bias(y).reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _reference(self, x: "torch.Tensor") -> "torch.Tensor":
        """Dequantize and multiply (a native layer without its kernels)."""
        act = x.to(torch.bfloat16) if self.kind == "bf16" else x.float() if self.kind == "fp32" else x
        weight = self.dense_weight().to(act.dtype if act.dtype in (torch.bfloat16, torch.float32) else self.dtype)
        return self._add_bias(torch.nn.functional.linear(act.to(weight.dtype), weight)).to(x.dtype)

    def _add_bias(self, y: "torch.Tensor") -> "torch.Tensor":
        return y if self.bias is None else y + self.bias.to(y.dtype)
