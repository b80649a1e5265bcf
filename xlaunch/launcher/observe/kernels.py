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
  ``...,info,oneDNN v3.12.0 (commit ...)``, ``...,info,cpu,runtime:OpenMP,nthr:2``,
  ``...,primitive,info,template:...``;
* xlaunch's own marks, written by :mod:`xlaunch.kernels.build_mark` around ``optimize``'s and
  ``quantize``'s builds: ``xlaunch_verbose,build,start,<what>`` and ``xlaunch_verbose,build,end,<what>``.

**Two oneDNN libraries in one process.** torch links its own oneDNN and OpenVINO bundles another
(torch 2.13: v3.12.0, OpenMP runtime; OpenVINO 2026.4: v3.13.0, threadpool runtime). Each prints
its own header block (version, runtime, ISA) before its first line, then both write the same line
layout to the same stdout. A line is counted under the library that owns its primitive (the one
under which that primitive -- everything on the line but the operation and the time -- was first
seen); a primitive not seen before goes to the library whose header came last. This is exact
while the two do not create new primitives at the same time, which is how a program runs once
its build is over (OpenVINO creates its primitives when it compiles and on its first call; eager
torch creates or fetches the same primitives on every call).
"""
from __future__ import annotations

import re

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional

from xlaunch.kernels.build_mark import MARK_PREFIX

MARKERS = ("onednn_verbose", "dnnl_verbose", MARK_PREFIX)
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
# A creation or execution line names its engine first; ``create:dispatch`` (an implementation
# passed over, ``ONEDNN_VERBOSE=dispatch`` or ``all``) and ``create:check`` are notes, not creations.
_ENGINES = frozenset({"cpu", "gpu"})
_NOTES = frozenset({"create:dispatch", "create:check"})
_NOT_TEXT = re.compile("[\x00-\x08\x0a-\x1f\x7f\ufffd]")   # tabs pass; U+FFFD: bytes that were not UTF-8
MAX_SIGNATURES = 8192      # distinct primitives remembered to tell a re-creation from a first one


def isa_of(impl: str) -> str:
    """The ISA an implementation name carries (``jit:avx2`` -> ``avx2``), or "" (``gemm:jit``, ``ref:any``)."""
    return next((token for token in impl.split(":") if _ISA_TOKEN.match(token)), "")


class Line:
    """One parsed verbose line. ``what`` is ``info`` (a header), ``create``, ``exec``, ``other``, or
    ``mark`` (xlaunch's build mark: ``cache`` holds ``start`` or ``end``, ``problem`` what is built)."""

    __slots__ = ("what", "isa", "version", "runtime", "cache", "kind", "impl", "tensors", "problem", "signature")

    def __init__(self, what: str) -> None:
        self.what = what
        self.isa = self.version = self.runtime = self.cache = self.kind = self.impl = self.problem = ""
        self.signature = ""
        self.tensors: dict[str, tuple[str, str]] = {}     # name -> (data type, format tag)


def parse_line(text: str) -> Optional[Line]:
    """The line as oneDNN meant it, or None when it is not a verbose line of a known layout (oneDNN
    prints text: a line with control characters or undecodable bytes is someone else's)."""
    text = text.rstrip("\r\n")
    fields = text.split(",")
    if fields[0] not in MARKERS or len(fields) < 3 or _NOT_TEXT.search(text):
        return None
    if fields[0] == MARK_PREFIX:
        if fields[1] != "build" or fields[2] not in ("start", "end"):
            return None
        mark = Line("mark")
        mark.cache, mark.problem = fields[2], ",".join(fields[3:])
        return mark
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
    if api != "primitive" or not (operation == "exec" or operation.startswith("create:")) or len(rest) < 4 \
            or rest[0].split(":")[0] not in _ENGINES or operation in _NOTES:
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
    elif rest.startswith("cpu,runtime:"):
        line.runtime = rest[len("cpu,runtime:"):].split(",")[0].strip()
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


# Who printed a runtime: torch's wheels build oneDNN with OpenMP, OpenVINO's with its threadpool (TBB).
OWNER_BY_RUNTIME = {"OpenMP": "torch", "threadpool": "OpenVINO"}


class _Counts:
    """Creation (or execution) lines of one section, counted per kind, implementation and layout."""

    def __init__(self) -> None:
        self.total = 0
        self.impls: dict[str, dict[str, int]] = {}          # kind -> impl -> lines
        self.data_types: dict[str, set[str]] = {}           # kind -> src/wei data types
        self.weight_tags: dict[str, str] = {}               # blocked weight layout -> the compute kind asking for it
        self.reorders_to: dict[str, int] = {}               # destination tag -> reorders
        self.reorders_distinct: dict[str, set[str]] = {}    # destination tag -> distinct problems

    def add(self, line: Line) -> None:
        self.total += 1
        kind = line.kind
        impls = self.impls.setdefault(kind, {})
        impls[line.impl] = impls.get(line.impl, 0) + 1
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

    def calls(self) -> int:
        return sum(sum(impls.values()) for kind, impls in self.impls.items() if kind in COMPUTE_KINDS)

    def weight_reorders(self) -> dict[str, tuple[int, int]]:
        """Per compute kind: (reorders into a layout it wanted its weights in, distinct such reorders)."""
        out: dict[str, tuple[int, int]] = {}
        for tag, kind in self.weight_tags.items():
            total, distinct = out.get(kind, (0, 0))
            out[kind] = (total + self.reorders_to.get(tag, 0), distinct + len(self.reorders_distinct.get(tag, ())))
        return {kind: counts for kind, counts in out.items() if counts[0]}


class Section:
    """The lines of one oneDNN library (its header: version, runtime, ISA), or of the builds."""

    def __init__(self, version: str = "") -> None:
        self.version = version
        self.isa = ""
        self.runtime = ""
        self.lines = 0
        self.created = _Counts()
        self.executed = _Counts()
        self.cache: dict[str, int] = {}                     # cache_miss / cache_hit / ... -> count
        self.recreated: dict[str, int] = {}                 # kind -> misses of a primitive seen before
        self.other_lines = 0

    def header(self) -> tuple[str, str, str]:
        return self.version, self.runtime, self.isa

    def add(self, line: Line, seen_before: bool) -> None:
        self.lines += 1
        if line.what == "exec":
            self.executed.add(line)
        elif line.what == "create":
            self.created.add(line)
            self.cache[line.cache] = self.cache.get(line.cache, 0) + 1
            if line.cache == "cache_miss" and seen_before:
                self.recreated[line.kind] = self.recreated.get(line.kind, 0) + 1
        elif line.what == "other":
            self.other_lines += 1

    def to_json(self) -> dict[str, Any]:
        """Counted from the creation lines when there are any (``profile_create``, eager frameworks
        create or fetch every primitive on every call), else from the execution lines (a user's
        ``ONEDNN_VERBOSE=1`` or ``all``)."""
        counts, basis = (self.created, "creations") if self.created.total or not self.executed.total \
            else (self.executed, "executions")
        calls = counts.calls()
        per_kind = counts.weight_reorders()
        weights = sum(total for total, _ in per_kind.values())
        weighed_calls = sum(sum(counts.impls[kind].values()) for kind in per_kind)
        return {
            "isa": self.isa or None,
            "onednn_version": self.version or None,
            "runtime": self.runtime or None,
            "owner": OWNER_BY_RUNTIME.get(self.runtime),
            "lines": self.lines,
            "counted": basis,
            "primitives": {
                kind: {"implementations": dict(sorted(impls.items(), key=lambda kv: -kv[1])),
                       basis: sum(impls.values()),
                       "count": sum(impls.values()),
                       "data_types": sorted(counts.data_types.get(kind, ())),
                       "recreated": self.recreated.get(kind, 0),
                       **({"weight_reorders": per_kind[kind][0], "weight_reorders_distinct": per_kind[kind][1]}
                          if kind in per_kind else {})}
                for kind, impls in sorted(counts.impls.items())
            },
            "calls": calls,
            "cache_misses": self.cache.get("cache_miss", 0),
            "cache_hits": self.cache.get("cache_hit", 0),
            "recreated": sum(self.recreated.values()),
            "weight_reorders": weights,
            "weight_reorders_distinct": sum(distinct for _, distinct in per_kind.values()),
            "weight_reorders_per_call": round(weights / weighed_calls, 3) if weighed_calls else None,
            "data_types": sorted({t for kind, types in counts.data_types.items() if kind in COMPUTE_KINDS
                                  for t in types}),
            "exec_lines": self.executed.total,
            "other_lines": self.other_lines,
        }


class KernelTally:
    """Counts of one instance's verbose lines, fed one line at a time (:meth:`add`): one
    :class:`Section` per oneDNN library seen, in the order their headers came, and one for the
    lines printed between xlaunch's build marks (``optimize``/``quantize`` building, checking
    and timing routes), which the steady-state sections leave out.

    Memory stays bounded: counters per (kind, implementation) and per reorder layout, and at
    most :data:`MAX_SIGNATURES` distinct primitives remembered (to tell a re-creation from a
    first one, and which library a primitive belongs to).
    """

    def __init__(self) -> None:
        self.lines = 0
        self.libraries: list[Section] = []
        self.build = Section()
        self.builds = 0                 # build marks seen (starts)
        self._depth = 0                 # builds open now (optimize inside quantize nests)
        self._current: Optional[Section] = None
        self._owner: dict[str, Section] = {}

    @property
    def isa(self) -> str:
        return self.libraries[0].isa if self.libraries else ""

    @property
    def version(self) -> str:
        return self.libraries[0].version if self.libraries else ""

    @property
    def exec_lines(self) -> int:
        return sum(library.executed.total for library in self.libraries) + self.build.executed.total

    def add(self, text: str) -> Optional[Line]:
        """Count one line; return it parsed, or None (and count nothing) when it is not verbose."""
        line = parse_line(text)
        if line is None:
            return None
        if line.what == "mark":
            if line.cache == "start":
                self.builds += 1
                self._depth += 1
            else:
                self._depth = max(0, self._depth - 1)
            return line
        self.lines += 1
        if line.what == "info":
            self._header(line)
            return line
        library = self._current if self._current is not None else self._new_library("")
        seen = False
        if line.signature:
            owner = self._owner.get(line.signature)
            if owner is not None:
                library, seen = owner, True
            elif len(self._owner) < MAX_SIGNATURES:
                self._owner[line.signature] = library
        (self.build if self._depth else library).add(line, seen)
        return line

    def _new_library(self, version: str) -> Section:
        self._current = Section(version)
        self.libraries.append(self._current)
        return self._current

    def _header(self, line: Line) -> None:
        if line.version:
            self._new_library(line.version)
            return
        library = self._current if self._current is not None else self._new_library("")
        library.lines += 1
        if line.runtime:
            library.runtime = line.runtime
        if line.isa:
            library.isa = line.isa
            # the same library's header again (a child process, a fork): one section for both
            twin = next((other for other in self.libraries if other is not library and other.header() ==
                         library.header()), None)
            if twin is not None and not (library.created.total or library.executed.total):
                twin.lines += library.lines
                self.libraries.remove(library)
                self._current = twin

    # ------------------------------------------------------------------ results

    def calls(self) -> int:
        """Steady-state calls of compute primitives, over every library."""
        return sum(library.to_json()["calls"] for library in self.libraries)

    def to_json(self) -> dict[str, Any]:
        """The ``observed.kernels`` object of ``--summary-json`` (docs/runner.md, "Kernel report"):
        the first library's fields at the top (torch's, in a torch program), every library under
        ``libraries``, the builds' lines under ``build`` (None when no build was marked)."""
        sections = [library.to_json() for library in self.libraries]
        first = dict(sections[0]) if sections else Section().to_json()
        first.update({
            "lines": self.lines,
            "libraries": sections,
            "build": {**self.build.to_json(), "builds": self.builds} if self.builds else None,
        })
        return first
