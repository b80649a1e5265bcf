"""The search space: a ``[space]`` TOML table of launcher option names -> lists of values.

Keys are the launcher's own config-file option names (``ninstances``, ``ncores-per-instance``,
``memory-allocator``, ...; any spelling the launcher accepts). Every value is checked by the
launcher's own option validation (:func:`~xlaunch.launcher.plan.options.build_options`) together with
the options fixed on the ``xlaunch-tune`` command line; a bad key, a bad value, an empty list
or a duplicate is one :class:`SpaceError` before anything runs. Combinations of valid values
that the launcher or its planner reject are not errors: the tuner skips them with a reason.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from xlaunch.launcher.api import OptionError, build_options, canonical_name, flag_name

# options that cannot be a dimension, and why
NOT_TUNABLE: dict[str, str] = {
    "log_dir": "xlaunch-tune sets it for every trial",
    "log_file_prefix": "xlaunch-tune sets it for every trial",
    "summary_json": "xlaunch-tune sets it for every run",
    "dry_run": "a dry run measures nothing",
    "json": "xlaunch-tune reads the plan itself",
    "verbosity": "it changes messages, not speed",
    "module": "it describes the program: give it on the xlaunch-tune command line",
    "no_python": "it describes the program: give it on the xlaunch-tune command line",
    "instance_idx": "it would run only part of each plan",
    "keep_going": "it is supervision, not placement: give it on the command line",
    "grace_period": "it is supervision, not placement: give it on the command line",
}

Point = dict[str, Any]          # config-file key (dashed) -> value, in the space's order


class SpaceError(ValueError):
    """A search space that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Dimension:
    """One option the tuner varies."""

    name: str                   # canonical launcher option name: ncores_per_instance
    values: tuple[Any, ...]     # as written to config files (bool, int, float or str)

    @property
    def key(self) -> str:
        """The config-file spelling: ``ncores-per-instance``."""
        return self.name.replace("_", "-")


@dataclass(frozen=True)
class Space:
    dimensions: tuple[Dimension, ...]
    source: str                 # the file, or "default space (machine model)"

    @property
    def size(self) -> int:
        size = 1
        for dimension in self.dimensions:
            size *= len(dimension.values)
        return size

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(d.key for d in self.dimensions)

    def points(self) -> Iterator[Point]:
        """Every point, in grid order (the last dimension varies fastest)."""
        for values in itertools.product(*(d.values for d in self.dimensions)):
            yield dict(zip(self.keys, values))

    def point_at(self, index: int) -> Point:
        """The ``index``-th point of :meth:`points` without enumerating the others."""
        point: Point = {}
        for dimension in reversed(self.dimensions):
            index, position = divmod(index, len(dimension.values))
            point[dimension.key] = dimension.values[position]
        return {key: point[key] for key in self.keys}

    def to_json(self) -> dict[str, list[Any]]:
        return {d.key: list(d.values) for d in self.dimensions}

    def shown(self, most: int = 8) -> str:
        """``ninstances [1, 2], omp-runtime ['default', 'intel']`` for the start line; a dimension of
        more than ``most`` values is cut (a space file of 1 MiB made a start line of 1 MB)."""
        def values(d: Dimension) -> str:
            cut = len(d.values) > most
            return str(list(d.values[:most]))[:-1] + f", ... ({len(d.values)} values)]" if cut else str(list(d.values))
        return ", ".join(f"{d.key} {values(d)}" for d in self.dimensions) or "no dimension"


def point_key(point: Mapping[str, Any]) -> str:
    """A stable text key for a point (for caches and resume)."""
    return json.dumps(sorted(point.items()), separators=(",", ":"))


SHORT_KEYS = {
    "ninstances": "inst", "ncores-per-instance": "cores", "memory-allocator": "malloc",
    "omp-runtime": "omp", "use-logical-cores": "smt", "bind-numa-node": "numa-bind",
}
"""Column and plot labels for the usual dimensions (keeps the result table within 80 columns)."""


def short_key(key: str) -> str:
    return SHORT_KEYS.get(key, key)


def describe(point: Mapping[str, Any]) -> str:
    """``ninstances=2 memory-allocator=jemalloc`` (for tables and plots)."""
    return " ".join(f"{key}={_short(value)}" for key, value in point.items()) or "(launcher defaults)"


def _short(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def parse_space(
    text: str,
    source: str,
    *,
    fixed: Mapping[str, Any],
    base_config: Optional[Mapping[str, Any]] = None,
) -> Space:
    """Read a space file's text. ``fixed``: launcher options given on the command line
    (canonical names); ``base_config``: the ``--config`` table every trial starts from."""
    from xlaunch.configs import parse_toml

    try:
        document = parse_toml(text)
    except ValueError as exc:
        raise SpaceError(f"{source} is not valid TOML: {exc}") from None
    extra = [key for key in document if key != "space"]
    if extra:
        raise SpaceError(f"{source}: unknown top-level key {extra[0]!r} (expected only a [space] table)")
    table = document.get("space")
    if not isinstance(table, dict):
        raise SpaceError(f"{source}: no [space] table")
    if not table:
        raise SpaceError(f"{source}: the [space] table is empty")
    dimensions: list[Dimension] = []
    seen: dict[str, str] = {}
    for key, values in table.items():
        name = _tunable_name(key, source)
        if name in seen:
            raise SpaceError(f"{source}: {key!r} and {seen[name]!r} name the same option")
        seen[name] = key
        if any(canonical_name(k) == name for k in fixed):
            raise SpaceError(f"{source}: {key} is fixed on the command line and also in the space")
        if not isinstance(values, list):
            raise SpaceError(f"{source}: {key} must be a list of values, got {values!r}")
        if not values:
            raise SpaceError(f"{source}: {key} is an empty list")
        dimensions.append(Dimension(name, _checked_values(name, values, source, fixed, base_config)))
    return Space(tuple(dimensions), source)


def _tunable_name(key: str, source: str) -> str:
    name = canonical_name(str(key)) if not str(key).startswith("-") else None
    if name is None:
        import difflib

        from xlaunch.launcher.api import SETTABLE

        known = sorted(n.replace("_", "-") for n in SETTABLE if n not in NOT_TUNABLE)
        close = difflib.get_close_matches(str(key).replace("_", "-"), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpaceError(f"{source}: unknown launcher option {key!r}{hint}")
    if name in NOT_TUNABLE:
        raise SpaceError(f"{source}: {key} cannot be tuned: {NOT_TUNABLE[name]}")
    return name


def _checked_values(
    name: str, values: list[Any], source: str, fixed: Mapping[str, Any], base_config: Optional[Mapping[str, Any]]
) -> tuple[Any, ...]:
    """Each value through the launcher's validation; returned as the launcher normalised it."""
    checked: list[Any] = []
    seen: set[Any] = set()          # a list's `in` made a 1 MiB file of values take minutes
    for value in values:
        shown = f"{name.replace('_', '-')} = {_shown(value)}"
        try:
            options = build_options({**fixed, name: value}, base_config)
        except OptionError as exc:
            where = "" if exc.option == flag_name(name) else f"{exc.option} "
            raise SpaceError(f"{source}: {shown}: {where}{exc.problem}") from None
        normal = getattr(options, name)
        if name == "membind" and options.membind_nodes is not None:    # numactl's spelling: membind = "1"
            normal = options.membind_nodes
        if normal is None:                     # nodes-list = "-1": every node, as when it is not given
            normal = "-1"
        elif isinstance(normal, tuple) and all(isinstance(item, str) for item in normal):
            normal = ",".join(normal)          # share-imports: module names, as --share-imports takes them
        elif isinstance(normal, tuple):        # CPU / node lists: the launcher's list syntax
            from xlaunch.cpulist import format_cpulist

            normal = format_cpulist(normal)
        if normal in seen:
            raise SpaceError(f"{source}: {shown}: duplicate value")
        seen.add(normal)
        checked.append(normal)
    return tuple(checked)


def _shown(value: Any) -> str:
    from xlaunch.tune.tomlfile import toml_value

    try:
        return toml_value(value)
    except (TypeError, ValueError):
        return repr(value)


def default_space(machine: Any, *, fixed: Mapping[str, Any], base_config: Optional[Mapping[str, Any]] = None) -> Space:
    """A space from the machine model: instance counts that fill the usable cores, the
    allocators and OpenMP runtimes installed, SMT on/off where cores have siblings.
    Dimensions fixed on the command line, and values the fixed options rule out, are left out."""
    from xlaunch.machine.model import PERFORMANCE

    allowed = set(machine.allowed_cpus) & set(machine.online_cpus)
    cores = [c for c in machine.cores if set(c.cpus) & allowed]
    if machine.is_hybrid:
        cores = [c for c in cores if c.kind == PERFORMANCE] or cores
    count = len(cores)
    candidates: list[tuple[str, list[Any]]] = [
        ("ninstances", [n for n in range(1, count + 1) if count % n == 0]),
        ("memory_allocator", ["default"] + [
            kind for kind, libs in (("jemalloc", ("jemalloc",)), ("tcmalloc", ("tcmalloc", "tcmalloc_minimal")))
            if any(machine.library(lib) is not None for lib in libs)
        ]),
        ("omp_runtime", ["default"] + (["intel"] if machine.library("iomp") is not None else [])),
    ]
    if any(len(set(c.cpus) & allowed) > 1 for c in cores):
        candidates.append(("use_logical_cores", [False, True]))
    dimensions = []
    for name, values in candidates:
        if any(canonical_name(k) == name for k in fixed):
            continue
        kept = []
        for value in values:
            try:
                build_options({**fixed, name: value}, base_config)
            except OptionError:
                continue
            kept.append(value)
        if len(kept) > 1:
            dimensions.append(Dimension(name, tuple(kept)))
    return Space(tuple(dimensions), "default space (machine model)")
