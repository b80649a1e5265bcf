"""oneDNN's verbose lines, parsed and counted: which kernels a program really ran.

Pure: lines in, counts out. The runner feeds an instance's lines through
:class:`~xlaunch.launcher.observe.kernel_filter.VerboseFilter`; ``--check-isa --probe`` parses its
child's output with :func:`parse_line`. Text and warnings are :mod:`.kernel_report`.

The line layouts read (oneDNN's ``doc/performance_considerations/verbose.md`` over the versions):

* 3.2+: ``onednn_verbose,v1[,<timestamp>],primitive,create:cache_miss,cpu,<kind>,<impl>,<prop>,
  <tensors>,<attributes>,<auxiliary>,<problem>,<ms>``; tensors as ``src:f32:a:blocked:abcd::f0``
  (3.4+) or ``src_f32:a:blocked:abcd::f0`` (earlier);
* 3.0-3.1: the same without the ``v1`` field;
* 1.x-2.x: ``onednn_verbose|dnnl_verbose[,<timestamp>],create:cache_miss|exec,cpu,<kind>,...``
  (no ``primitive`` field);
* headers: ``onednn_verbose,v1,info,cpu,isa:Intel AVX2`` (the ISA text may hold commas),
  ``...,info,oneDNN v3.12.0 (commit ...)``, ``...,primitive,info,template:...``.
"""
from __future__ import annotations

import re

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional

MARKERS = ("onednn_verbose", "dnnl_verbose")
# Kinds that compute (their weights may be re-laid-out); every other kind is counted, not judged.
COMPUTE_KINDS = frozenset({"convolution", "deconvolution", "inner_product", "matmul", "rnn"})
API_KINDS = frozenset({"primitive", "graph", "common", "ukernel", "gemm_api"})
# ISA spellings inside implementation names: jit:avx2, brg_conv_fwd:avx512_core_amx, brg_matmul:avx10_1_512_amx
_ISA_TOKEN = re.compile(r"^(sse41|avx\w*|amx\w*)$")
_VERSION_FIELD = re.compile(r"^v\d+$")
_TIMESTAMP = re.compile(r"^\d+(\.\d*)?$")
_DATA_TYPES = ("f32", "bf16", "f16", "s8", "u8", "s32", "f64", "f8_e5m2", "f8_e4m3", "s4", "u4", "f4_e2m1",
               "f4_e3m0", "e8m0", "boolean", "undef")
_OLD_TENSOR = re.compile(r"^([a-z_]+?)_(" + "|".join(_DATA_TYPES) + r")$")
MAX_SIGNATURES = 8192      # distinct primitives remembered to tell a re-creation from a first one


def isa_of(impl: str) -> str:
    """The ISA an implementation name carries (``jit:avx2`` -> ``avx2``), or "" (``gemm:jit``, ``ref:any``)."""
    return next((token for token in impl.split(":") if _ISA_TOKEN.match(token)), "")


class Line:
    """One parsed verbose line. ``what`` is ``info`` (a header), ``create``, ``exec`` or ``other``."""

    __slots__ = ("what", "isa", "version", "cache", "kind", "impl", "tensors", "problem", "signature")

    def __init__(self, what: str) -> None:
        self.what = what
        self.isa = self.version = self.cache = self.kind = self.impl = self.problem = self.signature = ""
        self.tensors: dict[str, tuple[str, str]] = {}     # name -> (data type, format tag)


def parse_line(text: str) -> Optional[Line]:
    """The line as oneDNN meant it, or None when it is not a verbose line of a known layout."""
    fields = text.rstrip("\r\n").split(",")
    if fields[0] not in MARKERS or len(fields) < 3:
        return None
    at = 1
    if _VERSION_FIELD.match(fields[at]):
        at += 1
    if at < len(fields) and _TIMESTAMP.match(fields[at]):
        at += 1
    if at >= len(fields):
        return None
    token = fields[at]
    if token == "info":
        return _header(",".join(fields[at + 1:]))
    if token in API_KINDS:
        if at + 1 >= len(fields):
            return None
        api, operation, rest = token, fields[at + 1], fields[at + 2:]
    elif token == "exec" or token.startswith("create:"):
        api, operation, rest = "primitive", token, fields[at + 1:]     # 1.x-2.x: no API field
    else:
        return None
    if operation == "info":
        return Line("info")                                         # the template line
    if api != "primitive" or not (operation == "exec" or operation.startswith("create:")) or len(rest) < 4:
        return Line("other")                                        # graph API, errors, checks, dispatch notes
    line = Line("exec" if operation == "exec" else "create")
    line.cache = operation[len("create:"):] if line.what == "create" else ""
    line.kind, line.impl = rest[1], rest[2]
    if len(rest) > 4:
        line.tensors = _tensors(rest[4])
    line.problem = rest[-2] if len(rest) >= 6 else ""
    # what makes the primitive this one: everything but the operation and the time taken
    line.signature = ",".join(rest[1:-1])
    return line


def _header(rest: str) -> Line:
    line = Line("info")
    if rest.startswith("cpu,isa:"):
        line.isa = rest[len("cpu,isa:"):].strip()
    else:
        found = re.match(r"^(?:oneDNN|DNNL) (v[\w.]+)", rest)
        if found:
            line.version = found.group(1)
    return line


def _tensors(field: str) -> dict[str, tuple[str, str]]:
    """``src:f32:a:blocked:abcd::f0 wei:...`` (or ``src_f32::blocked:abcd::f0``) -> name -> (type, tag)."""
    out: dict[str, tuple[str, str]] = {}
    for item in field.split():
        parts = item.split(":")
        old = _OLD_TENSOR.match(parts[0])
        if old:
            name, dtype, tag = old.group(1), old.group(2), parts[3] if len(parts) > 3 else ""
        elif len(parts) > 4:
            name, dtype, tag = parts[0], parts[1], parts[4]
        else:
            continue
        out[name] = (dtype, tag)
    return out


def is_plain(tag: str) -> bool:
    """``abcd``, ``ba``: a plain (unblocked) layout; ``Acdb8a``, ``aBcd8b``: blocked."""
    return tag.isalpha() and tag.islower()


class KernelTally:
    """Counts of one instance's verbose lines, fed one line at a time (:meth:`add`).

    Memory stays bounded: counters per (kind, implementation) and per reorder layout, and at
    most :data:`MAX_SIGNATURES` distinct primitives remembered to spot re-creations.
    """

    def __init__(self) -> None:
        self.isa = ""
        self.version = ""
        self.lines = 0
        self.creates: dict[str, dict[str, int]] = {}        # kind -> impl -> creations
        self.data_types: dict[str, set[str]] = {}           # kind -> src/wei data types
        self.cache: dict[str, int] = {}                     # cache_miss / cache_hit / ... -> count
        self.recreated: dict[str, int] = {}                 # kind -> misses of a primitive seen before
        self.exec_lines = 0
        self.other_lines = 0
        self.weight_tags: dict[str, str] = {}               # blocked weight layout -> the compute kind asking for it
        self.reorders_to: dict[str, int] = {}               # destination tag -> reorder creations
        self.reorders_distinct: dict[str, set[str]] = {}    # destination tag -> distinct problems
        self._seen: set[str] = set()

    def add(self, text: str) -> Optional[Line]:
        """Count one line; return it parsed, or None (and count nothing) when it is not verbose."""
        line = parse_line(text)
        if line is None:
            return None
        self.lines += 1
        if line.what == "info":
            self.isa = line.isa or self.isa
            self.version = line.version or self.version
        elif line.what == "exec":
            self.exec_lines += 1
        elif line.what == "other":
            self.other_lines += 1
        else:
            self._creation(line)
        return line

    def _creation(self, line: Line) -> None:
        kind = line.kind
        impls = self.creates.setdefault(kind, {})
        impls[line.impl] = impls.get(line.impl, 0) + 1
        self.cache[line.cache] = self.cache.get(line.cache, 0) + 1
        if line.cache == "cache_miss":
            if line.signature in self._seen:
                self.recreated[kind] = self.recreated.get(kind, 0) + 1
            elif len(self._seen) < MAX_SIGNATURES:
                self._seen.add(line.signature)
        if kind == "reorder":
            tag = line.tensors.get("dst", ("", ""))[1]
            if tag and not is_plain(tag):
                self.reorders_to[tag] = self.reorders_to.get(tag, 0) + 1
                problems = self.reorders_distinct.setdefault(tag, set())
                if len(problems) < 64:
                    problems.add(line.problem)
            return
        types = self.data_types.setdefault(kind, set())
        for name in ("src", "wei"):
            dtype, tag = line.tensors.get(name, ("", ""))
            if dtype and dtype != "undef":
                types.add(dtype)
            if name == "wei" and tag and not is_plain(tag):
                self.weight_tags.setdefault(tag, kind)

    # ------------------------------------------------------------------ results

    def calls(self) -> int:
        """Creations of compute primitives: eager frameworks create (or fetch) one per call."""
        return sum(sum(impls.values()) for kind, impls in self.creates.items() if kind in COMPUTE_KINDS)

    def weight_reorders(self) -> dict[str, tuple[int, int]]:
        """Per compute kind: (reorders into a layout it wanted its weights in, distinct such reorders)."""
        out: dict[str, tuple[int, int]] = {}
        for tag, kind in self.weight_tags.items():
            total, distinct = out.get(kind, (0, 0))
            out[kind] = (total + self.reorders_to.get(tag, 0), distinct + len(self.reorders_distinct.get(tag, ())))
        return {kind: counts for kind, counts in out.items() if counts[0]}

    def to_json(self) -> dict[str, Any]:
        """The ``observed.kernels`` object of ``--summary-json`` (docs/runner.md, "Kernel report")."""
        calls = self.calls()
        per_kind = self.weight_reorders()
        weights = sum(total for total, _ in per_kind.values())
        weighed_calls = sum(sum(self.creates[kind].values()) for kind in per_kind)
        return {
            "isa": self.isa or None,
            "onednn_version": self.version or None,
            "lines": self.lines,
            "primitives": {
                kind: {"implementations": dict(sorted(impls.items(), key=lambda kv: -kv[1])),
                       "creations": sum(impls.values()),
                       "data_types": sorted(self.data_types.get(kind, ())),
                       "recreated": self.recreated.get(kind, 0),
                       **({"weight_reorders": per_kind[kind][0], "weight_reorders_distinct": per_kind[kind][1]}
                          if kind in per_kind else {})}
                for kind, impls in sorted(self.creates.items())
            },
            "calls": calls,
            "cache_misses": self.cache.get("cache_miss", 0),
            "cache_hits": self.cache.get("cache_hit", 0),
            "recreated": sum(self.recreated.values()),
            "weight_reorders": weights,
            "weight_reorders_per_call": round(weights / weighed_calls, 3) if weighed_calls else None,
            "data_types": sorted({t for kind, types in self.data_types.items() if kind in COMPUTE_KINDS
                                  for t in types}),
            "exec_lines": self.exec_lines,
        }
