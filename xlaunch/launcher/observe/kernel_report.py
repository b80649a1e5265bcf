"""The kernel report in words: one summary line per instance, a short cell for ``xlaunch-tune``,
and warnings where what ran is not what the machine or the user asked for.

Everything here reads the JSON object of :meth:`.kernels.KernelTally.to_json` (as written in
``--summary-json`` under ``observed.kernels``), so a tool reading that file back gets the same
text.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional

from xlaunch.launcher.observe.kernels import COMPUTE_KINDS, isa_of

_PLURAL = {"convolution": "convolutions", "deconvolution": "deconvolutions", "inner_product": "inner products",
           "matmul": "matmuls", "rnn": "RNNs"}
_SHORT_KIND = {"convolution": "conv", "deconvolution": "deconv", "inner_product": "ip", "matmul": "matmul",
               "rnn": "rnn"}
_LOW_PRECISION = {"bf16", "f16", "s8", "u8", "s4", "u4", "f8_e5m2", "f8_e4m3"}
MAX_IMPLS_SHOWN = 3
EVERY_CALL = 0.95          # weight reorders per call from which "on every call" is said
SOME_CALLS = 0.5           # ... and below which nothing is said (weights laid out once, then reused)


def short_isa(isa: Optional[str]) -> str:
    """oneDNN's ISA sentence in a few characters: ``AVX2``, ``AVX-512 VNNI BF16``, ``AMX``."""
    if not isa:
        return "?"
    if "AMX" in isa:
        return "AMX"
    if "AVX10" in isa:
        return "AVX10"
    for family in ("AVX-512", "AVX2", "AVX", "SSE4.1"):
        if family in isa:
            extras = [name for word, name in (("DL Boost", "VNNI"), ("bfloat16", "BF16"), ("float16", "FP16"))
                      if word in isa]
            return " ".join([family, *extras])
    return isa


def _types(types: list[str]) -> str:
    return "/".join(types) if types else "?"


def _impls(implementations: dict[str, int]) -> str:
    items = sorted(implementations.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{impl} {count}" for impl, count in items[:MAX_IMPLS_SHOWN])
    return text + (f", +{len(items) - MAX_IMPLS_SHOWN} more" if len(items) > MAX_IMPLS_SHOWN else "")


def kernel_line(data: dict[str, Any]) -> str:
    """``oneDNN v3.12.0, AVX2; convolution: jit:avx2 30 (f32); reorders 90, of weights 30 (1.00 per
    call); re-created 0`` -- or why there is nothing to show."""
    if not data.get("lines"):
        return "no oneDNN line (nothing ran through oneDNN, or its verbose output is off)"
    head = ", ".join(part for part in (f"oneDNN {data['onednn_version']}" if data.get("onednn_version") else "",
                                       short_isa(data.get("isa"))) if part)
    primitives: dict[str, dict[str, Any]] = data.get("primitives", {})
    parts = [head]
    compute = [kind for kind in primitives if kind in COMPUTE_KINDS]
    for kind in compute:
        entry = primitives[kind]
        parts.append(f"{kind}: {_impls(entry['implementations'])} ({_types(entry['data_types'])})")
    others = [kind for kind in primitives if kind not in COMPUTE_KINDS and kind != "reorder"]
    if others:
        count = sum(primitives[kind]["creations"] for kind in others)
        parts.append(f"{count} other ({', '.join(others[:4])}{', ...' if len(others) > 4 else ''})")
    if not primitives:
        parts.append("no primitive created")
    reorders = primitives.get("reorder", {}).get("creations", 0)
    if reorders or compute:
        text = f"reorders {reorders}"
        if data.get("weight_reorders"):
            per_call = data.get("weight_reorders_per_call")
            text += f", of weights {data['weight_reorders']}" + (f" ({per_call:.2f} per call)" if per_call else "")
        parts.append(text)
        parts.append(f"re-created {data.get('recreated', 0)}")
    return "; ".join(parts)


def kernel_cell(data: Optional[dict[str, Any]]) -> str:
    """A few words for a table cell: ``AVX2, conv avx2 f32, w 1.0/call``."""
    if not data:
        return "-"
    if not data.get("lines"):
        return "no oneDNN"
    primitives: dict[str, dict[str, Any]] = data.get("primitives", {})
    words = [short_isa(data.get("isa"))]
    for kind, entry in primitives.items():
        if kind in COMPUTE_KINDS and entry["implementations"]:
            top = max(entry["implementations"].items(), key=lambda kv: kv[1])[0]
            words.append(f"{_SHORT_KIND[kind]} {isa_of(top) or top} {_types(entry['data_types'])}")
    per_call = data.get("weight_reorders_per_call")
    if per_call:
        words.append(f"w {per_call:.1f}/call")
    return ", ".join(words)


def kernel_warnings(data: dict[str, Any], requested_dtype: Optional[str] = None) -> list[str]:
    """Plain-word findings: precision not reached, AMX idle, weights re-laid-out, cache churn.

    ``requested_dtype``: what ``--auto-optimize`` asked the program's models to compute in (None:
    the program ran without it)."""
    primitives: dict[str, dict[str, Any]] = data.get("primitives", {})
    compute = {kind: entry for kind, entry in primitives.items() if kind in COMPUTE_KINDS and entry["creations"]}
    warnings: list[str] = []
    if requested_dtype == "bfloat16":
        for kind, entry in compute.items():
            types = set(entry["data_types"])
            if types and not types & _LOW_PRECISION:
                warnings.append(f"bf16 requested but {_PLURAL.get(kind, kind)} ran in {_types(sorted(types))}")
    isa = data.get("isa") or ""
    if "AMX" in isa:
        for kind, entry in compute.items():
            impls = entry["implementations"]
            if impls and not any("amx" in impl for impl in impls):
                top = max(impls.items(), key=lambda kv: kv[1])[0]
                types = entry["data_types"]
                why = "" if set(types) & _LOW_PRECISION else ": AMX computes in bf16 and int8 only"
                warnings.append(f"AMX available but not used ({kind} {top}, {_types(types)}){why}")
    for kind, entry in compute.items():
        weights, distinct = entry.get("weight_reorders", 0), entry.get("weight_reorders_distinct", 0)
        per_call = weights / entry["creations"]
        if weights > distinct and per_call >= SOME_CALLS:
            how_often = "on every call" if per_call >= EVERY_CALL else f"on {per_call:.0%} of calls"
            advice = ("even under --auto-optimize (what ran was not prepacked)" if requested_dtype is not None
                      else "try xlaunch.optimize")
            warnings.append(f"weights re-laid-out {how_often} ({kind}: {weights} weight reorders in "
                            f"{entry['creations']} calls): {advice}")
    if data.get("recreated"):
        warnings.append(f"{data['recreated']} oneDNN primitives built again after their first use (dropped from "
                        f"the primitive cache: raise ONEDNN_PRIMITIVE_CACHE_CAPACITY)")
    if data.get("exec_lines"):
        warnings.append(f"oneDNN printed {data['exec_lines']} per-execution lines (ONEDNN_VERBOSE asks for them): "
                        f"printing on every execution slows the program down")
    return warnings
