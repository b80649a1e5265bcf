"""How the planner cuts the ordered cores into instances (``--ninstances``, ``--ncores-per-instance``,
the modes, ``--bind-numa-node``): pure functions over :class:`Unit` lists.

* Equal slices by default: the count first, then the largest size that fits, each slice inside
  one L3 domain if it can, else one NUMA node, else anywhere (never across nodes with
  ``--bind-numa-node``); cores that make no whole slice stay idle, and a note says how many.
* ``--bind-numa-node --ninstances N`` (no size given) shares instances out like ipexrun: each
  node gets instances in proportion to its cores, and its cores are split among them, so no core
  of a node with an instance idles; instances of one node differ by at most one core, and nodes
  of different sizes give different sizes (2 nodes x 28 cores, 3 instances: 28, 14 and 14).
  Where a node's CPUs do not divide evenly, xlaunch differs from ipexrun: ipexrun gives every
  instance of the node the same share, rounded down, and leaves the rest idle (56 CPUs, 3
  instances: 18/18/18 and 2 idle); xlaunch gives the rest to the node's first instances
  (20/18/18 in whole cores: 10/9/9), so no CPU idles, and the plan's notes say so.
"""
from __future__ import annotations

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")

from xlaunch._records import record
from xlaunch.launcher.errors import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from typing import Callable, Optional

    from xlaunch.launcher.plan.options import Options

LATENCY_CORES_PER_INSTANCE = 4


@record
class Unit:
    """One physical core as the planner sees it: the CPUs it contributes, and where it sits."""

    cpus: tuple[int, ...]        # one CPU, or every allowed sibling with --use-logical-cores
    node: Optional[int]
    l3: Optional[int]


def shape(options: "Options", units: list[Unit]) -> tuple[list[list[Unit]], Optional[str]]:
    """Split the ordered units into instances; returns the slices and a note about idle cores."""

    total_units = len(units)
    if options.throughput_mode:
        slices = [list(group) for group in _groups(units, by_l3=False)]
        return slices, None
    by_cpu = options.use_logical_cores and options.ncores_per_instance is not None
    weight = (lambda unit: len(unit.cpus)) if by_cpu else (lambda unit: 1)
    total = sum(weight(u) for u in units)
    kind = "logical CPUs" if by_cpu else "cores"
    count: Optional[int]
    note = None
    if options.latency_mode:
        size, count = LATENCY_CORES_PER_INSTANCE, None
        if total < size:
            size = total
            note = f"--latency-mode: only {total} cores available, one instance of {total}"
    elif options.ninstances is not None and options.ncores_per_instance is not None:
        size, count = options.ncores_per_instance, options.ninstances
        if size * count > total:
            raise PlanError(
                "--ninstances",
                f"{count} instances x {size} {kind} need {size * count} {kind}, only {total} available",
            )
    elif options.ncores_per_instance is not None:
        size, count = options.ncores_per_instance, None
        if size > total:
            raise PlanError("--ncores-per-instance", f"{size} {kind} per instance, only {total} available")
    else:
        count = options.ninstances if options.ninstances is not None else 1
        if count > total_units:
            raise PlanError("--ninstances", f"{count} instances need at least {count} cores, only {total_units} available")
        size = total_units // count
        if options.bind_numa_node:
            slices = numa_node_shares(units, count)
            return slices, leftover_note(slices)
    levels = ("l3", "node") if options.bind_numa_node else ("l3", "node", "all")
    best: Optional[list[list[Unit]]] = None
    target = count
    if target is None:
        target = len(_pack(units, size, weight, levels[-1]))
        if target == 0 and by_cpu:
            raise PlanError(
                "--ncores-per-instance", f"{size} logical CPUs per instance would split a core's SMT siblings"
            )
        if target == 0:
            raise PlanError("--bind-numa-node", f"no NUMA node has {size} {kind} available")
    for level in levels:
        slices = _pack(units, size, weight, level)
        if len(slices) >= target:
            best = slices[:target]
            break
    if best is None and by_cpu and len(_pack(units, size, weight, "all")) < target:
        raise PlanError(
            "--ncores-per-instance",
            f"{target} instances of {size} logical CPUs do not fit without splitting a core's SMT siblings",
        )
    if best is None:
        raise PlanError("--bind-numa-node", f"{target} instances of {size} {kind} do not fit inside NUMA nodes")
    used = sum(len(s) for s in best)
    idle = total_units - used
    if idle and note is None:
        note = f"{idle} of {total_units} cores stay idle ({len(best)} instances x {size} {kind})"
    return best, note


def _groups(units: list[Unit], by_l3: bool) -> list[list[Unit]]:
    """Consecutive runs of units sharing a node (and an L3 domain when ``by_l3``)."""
    groups: list[list[Unit]] = []
    last: object = object()
    for unit in units:
        key = (unit.node, unit.l3) if by_l3 else unit.node
        if not groups or key != last:
            groups.append([])
            last = key
        groups[-1].append(unit)
    return groups


def _pack(units: list[Unit], size: int, weight: Callable[[Unit], int], level: str) -> list[list[Unit]]:
    """Greedy consecutive slices of exactly ``size`` (by ``weight``) that never cross a group
    boundary of ``level`` (l3, node, or all). A core that cannot complete a slice without
    splitting its SMT siblings stays idle."""
    groups = [units] if level == "all" else _groups(units, by_l3=level == "l3")
    slices: list[list[Unit]] = []
    for group in groups:
        current: list[Unit] = []
        filled = 0
        for unit in group:
            current.append(unit)
            filled += weight(unit)
            while filled > size:       # a core's siblings would be split: leave leading cores idle
                filled -= weight(current.pop(0))
            if filled == size:
                slices.append(current)
                current, filled = [], 0
    return slices


def numa_node_shares(units: list[Unit], count: int) -> list[list[Unit]]:
    """``count`` instances inside NUMA nodes, every core of a node that has one in use."""
    nodes = _groups(units, by_l3=False)
    slices: list[list[Unit]] = []
    for group, share in zip(nodes, instances_per_node([len(g) for g in nodes], count)):
        size, extra = divmod(len(group), share) if share else (0, 0)
        at = 0
        for k in range(share):
            width = size + (1 if k < extra else 0)
            slices.append(group[at:at + width])
            at += width
    return slices


def leftover_note(slices: list[list[Unit]]) -> Optional[str]:
    """Where a node's instances differ in size: what xlaunch did, and what ipexrun would have
    done (the same share for each, rounded down, the rest idle); None when every node divides evenly."""
    parts = []
    for node, group in _by_node(slices):
        cpus = [sum(len(unit.cpus) for unit in piece) for piece in group]
        if len(set(cpus)) > 1:
            each = sum(cpus) // len(cpus)
            idle = sum(cpus) - each * len(cpus)
            parts.append(f"node {node}'s {sum(cpus)} CPUs go to its {len(cpus)} instances as "
                         f"{'/'.join(map(str, cpus))} (ipexrun gives each {each} and leaves {idle} idle)")
    if not parts:
        return None
    return "--bind-numa-node: " + "; ".join(parts) + ": xlaunch leaves no CPU idle"


def _by_node(slices: list[list[Unit]]) -> list[tuple[Optional[int], list[list[Unit]]]]:
    out: list[tuple[Optional[int], list[list[Unit]]]] = []
    for piece in slices:
        node = piece[0].node if piece else None
        if out and out[-1][0] == node:
            out[-1][1].append(piece)
        else:
            out.append((node, [piece]))
    return out


def instances_per_node(sizes: list[int], count: int) -> list[int]:
    """How many of ``count`` instances each node (of ``sizes`` cores) gets: in proportion to its
    cores, rounded up, then taken back one at a time from the node whose instances are smallest
    (the first such node); when every node has one, from the smallest node (the last such node).
    ``count`` must not exceed ``sum(sizes)``."""
    total = sum(sizes)
    counts = [-(-count * size // total) if size else 0 for size in sizes]
    while sum(counts) > count:
        shared = [(sizes[i] / counts[i], i) for i in range(len(sizes)) if counts[i] > 1]
        if shared:
            at = min(shared)[1]
        else:
            at = min((i for i in range(len(sizes)) if counts[i]), key=lambda i: (sizes[i], -i))
        counts[at] -= 1
    return counts
