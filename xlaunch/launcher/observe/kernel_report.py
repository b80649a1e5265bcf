"""The kernel report in words: one summary line per instance, a short cell for ``xlaunch-tune``,
and warnings where what ran is not what the machine or the user asked for.

Everything here reads the JSON object of :meth:`.kernels.KernelTally.to_json` (as written in
``--summary-json`` under ``observed.kernels``), so a tool reading that file back gets the same
text. One part per oneDNN library seen (torch's, OpenVINO's bundled copy), steady state only; the
calls made while ``optimize``/``quantize`` built their routes are given apart and never judged.
"""
from __future__ import annotations

import re

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
RELAYOUT_ADVICE = ("a route that lays the weights out once removes this; `--auto-optimize --kernel-report` "
                   "shows whether the route xlaunch.optimize keeps on this machine does so")
RELAYOUT_UNDER_AUTO = "under --auto-optimize: the route it kept does not lay them out once here"
RELAYOUT_AFTER_BUILD = "after xlaunch.optimize/quantize built: what they kept does not lay them out once here"
EVERY_CALL = 0.95          # weight reorders per call from which "on every call" is said
SOME_CALLS = 0.5           # ... and below which nothing is said (weights laid out once, then reused)


# oneDNN's ISA sentences (3.x): "Intel AVX2", "Intel AVX2 with Intel DL Boost", "Intel AVX-512 with
# Intel DL Boost and bfloat16 support", "Intel AVX-512 with float16, Intel DL Boost and bfloat16
# support and Intel AMX with bfloat16 and 8-bit integer support", "Intel AVX10.1/512 with ..."
_WORDS = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-/]*")


def short_isa(isa: Optional[str]) -> str:
    """oneDNN's ISA sentence in a few characters: ``AVX2``, ``AVX-512 VNNI BF16``, ``AMX``.

    Whole words only: ``bfloat16`` says BF16 and never FP16; FP16 needs the word ``float16``."""
    if not isa:
        return "?"
    words = _WORDS.findall(isa)
    if "AMX" in words:
        return "AMX"
    family = next((name for word, name in (("AVX10.1/512", "AVX10"), ("AVX10", "AVX10"), ("AVX-512", "AVX-512"),
                                            ("AVX2", "AVX2"), ("AVX", "AVX"), ("SSE4.1", "SSE4.1"))
                   if word in words), "")
    if not family:
        return isa
    extras = [name for present, name in ((" DL Boost" in f" {isa}", "VNNI"), ("bfloat16" in words, "BF16"),
                                         ("float16" in words, "FP16")) if present]
    return " ".join([family, *extras])


def _types(types: list[str]) -> str:
    return "/".join(types) if types else "?"


def _impls(implementations: dict[str, int]) -> str:
    items = sorted(implementations.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{impl} {count}" for impl, count in items[:MAX_IMPLS_SHOWN])
    return text + (f", +{len(items) - MAX_IMPLS_SHOWN} more" if len(items) > MAX_IMPLS_SHOWN else "")


def _sections(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The steady-state part of each library (a JSON of before the libraries were told apart: itself)."""
    libraries = data.get("libraries")
    return list(libraries) if libraries is not None else [data]


def _name(section: dict[str, Any], several: bool) -> str:
    """``oneDNN v3.12.0``; with several libraries, whose: ``oneDNN v3.13.0 (threadpool: OpenVINO's)``."""
    name = f"oneDNN {section['onednn_version']}" if section.get("onednn_version") else "oneDNN"
    if several:
        runtime, owner = section.get("runtime"), section.get("owner")
        if runtime or owner:
            name += " (" + ": ".join(part for part in (runtime, f"{owner}'s" if owner else "") if part) + ")"
    return name


def _count(entry: dict[str, Any]) -> int:
    return entry.get("count", entry.get("creations", 0))


def _section_line(section: dict[str, Any], several: bool) -> str:
    parts = [f"{_name(section, several)}, {short_isa(section.get('isa'))}"]
    primitives: dict[str, dict[str, Any]] = section.get("primitives", {})
    executions = section.get("counted") == "executions"
    unit = " executions" if executions else ""
    compute = [kind for kind in primitives if kind in COMPUTE_KINDS]
    for kind in compute:
        entry = primitives[kind]
        parts.append(f"{kind}: {_impls(entry['implementations'])}{unit} ({_types(entry['data_types'])})")
    others = [kind for kind in primitives if kind not in COMPUTE_KINDS and kind != "reorder"]
    if others:
        count = sum(_count(primitives[kind]) for kind in others)
        parts.append(f"{count} other ({', '.join(others[:4])}{', ...' if len(others) > 4 else ''})")
    if not primitives:
        parts.append("no primitive created or executed")
    reorders = _count(primitives.get("reorder", {}))
    if reorders or compute:
        text = f"reorders {reorders}"
        if section.get("weight_reorders"):
            per_call = section.get("weight_reorders_per_call")
            text += f", of weights {section['weight_reorders']}" + (f" ({per_call:.2f} per call)" if per_call else "")
        parts.append(text)
        if not executions:
            parts.append(f"re-created {section.get('recreated', 0)}")
    if executions:
        parts.append(f"counted from {section.get('exec_lines', 0)} execution lines (no creation line)")
    return "; ".join(parts)


def kernel_line(data: dict[str, Any]) -> str:
    """``oneDNN v3.12.0, AVX2; convolution: jit:avx2 30 (f32); reorders 90, of weights 30 (1.00 per
    call); re-created 0`` (one part per library, `` | `` between), the builds' calls after them,
    or why there is nothing to show."""
    if not data.get("lines"):
        return "no oneDNN line (nothing ran through oneDNN, or its verbose output is off)"
    sections = [s for s in _sections(data) if s.get("lines")] or _sections(data)[:1]
    text = " | ".join(_section_line(section, len(sections) > 1) for section in sections)
    build = data.get("build")
    if build:
        text += (f" | while optimize/quantize built ({build.get('builds', 0)} builds, not counted above): "
                 f"{build.get('lines', 0)} lines, {build.get('calls', 0)} calls")
    return text


def kernel_cell(data: Optional[dict[str, Any]]) -> str:
    """A few words for a table cell: ``AVX2, conv avx2 f32, w 1.0/call`` (`` | `` between libraries)."""
    if not data:
        return "-"
    if not data.get("lines"):
        return "no oneDNN"
    sections = [s for s in _sections(data) if s.get("lines")] or _sections(data)[:1]
    cells = []
    for section in sections:
        primitives: dict[str, dict[str, Any]] = section.get("primitives", {})
        words = [short_isa(section.get("isa"))]
        if len(sections) > 1 and section.get("onednn_version"):
            words[0] = f"{section['onednn_version']} {words[0]}"
        for kind, entry in primitives.items():
            if kind in COMPUTE_KINDS and entry["implementations"]:
                top = max(entry["implementations"].items(), key=lambda kv: kv[1])[0]
                words.append(f"{_SHORT_KIND[kind]} {isa_of(top) or top} {_types(entry['data_types'])}")
        per_call = section.get("weight_reorders_per_call")
        if per_call and section.get("weight_reorders", 0) > section.get("weight_reorders_distinct", 0):
            words.append(f"w {per_call:.1f}/call")     # the same weights laid out again
        cells.append(", ".join(words))
    return " | ".join(cells)


def kernel_warnings(data: dict[str, Any], requested_dtype: Optional[str] = None) -> list[str]:
    """Plain-word findings on the steady state of each library: precision not reached, AMX idle,
    weights re-laid-out, cache churn, per-execution printing. A build's calls are never judged.

    ``requested_dtype``: what ``--auto-optimize`` asked the program's models to compute in (None:
    the program ran without it)."""
    sections = [s for s in _sections(data) if s.get("lines")]
    several = len(sections) > 1
    warnings: list[str] = []
    # under --auto-optimize, or after the program's own optimize/quantize built, what ran is what
    # they kept: advising them would not help
    advice = RELAYOUT_UNDER_AUTO if requested_dtype is not None else \
        RELAYOUT_AFTER_BUILD if data.get("build") else RELAYOUT_ADVICE
    for section in sections:
        prefix = f"{_name(section, True)}: " if several else ""
        warnings += [prefix + warning for warning in _section_warnings(section, requested_dtype, advice)]
    exec_lines = sum(section.get("exec_lines", 0) for section in sections)
    build = data.get("build") or {}
    exec_lines += build.get("exec_lines", 0)
    if exec_lines:
        warnings.append(f"oneDNN printed {exec_lines} per-execution lines (ONEDNN_VERBOSE asks for them): "
                        f"printing on every execution slows the program down")
    return warnings


def _section_warnings(section: dict[str, Any], requested_dtype: Optional[str], advice: str) -> list[str]:
    primitives: dict[str, dict[str, Any]] = section.get("primitives", {})
    compute = {kind: entry for kind, entry in primitives.items() if kind in COMPUTE_KINDS and _count(entry)}
    calls = "executions" if section.get("counted") == "executions" else "calls"
    warnings: list[str] = []
    if requested_dtype == "bfloat16":
        for kind, entry in compute.items():
            types = set(entry["data_types"])
            if types and not types & _LOW_PRECISION:
                warnings.append(f"bf16 requested but {_PLURAL.get(kind, kind)} ran in {_types(sorted(types))}")
    if "AMX" in _WORDS.findall(section.get("isa") or ""):
        for kind, entry in compute.items():
            impls = entry["implementations"]
            if impls and not any("amx" in impl for impl in impls):
                top = max(impls.items(), key=lambda kv: kv[1])[0]
                types = entry["data_types"]
                why = "" if set(types) & _LOW_PRECISION else ": AMX computes in bf16 and int8 only"
                warnings.append(f"AMX available but not used ({kind} {top}, {_types(types)}){why}")
    for kind, entry in compute.items():
        weights, distinct = entry.get("weight_reorders", 0), entry.get("weight_reorders_distinct", 0)
        per_call = weights / _count(entry)
        if weights > distinct and per_call >= SOME_CALLS:
            how_often = f"on every {calls[:-1]}" if per_call >= EVERY_CALL else f"on {per_call:.0%} of {calls}"
            warnings.append(f"weights re-laid-out {how_often} ({kind}: {weights} weight reorders in "
                            f"{_count(entry)} {calls}): {advice}")
    if section.get("recreated"):
        warnings.append(f"{section['recreated']} oneDNN primitives built again after their first use (dropped from "
                        f"the primitive cache: raise ONEDNN_PRIMITIVE_CACHE_CAPACITY)")
    return warnings
