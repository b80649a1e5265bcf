"""What this process may use: allowed CPUs and memory nodes, and the cgroup CPU budget.

Live (root ``/``) the allowed CPUs are ``os.sched_getaffinity(0)``; under a recorded root
they are ``Cpus_allowed_list`` from ``<root>/proc/self/status`` (restricted to online CPUs,
as ``sched_getaffinity`` is). The budget is the smallest cgroup quota on the way from this
process's cgroup to the root: v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Iterable, Optional

from xlaunch._records import record
from xlaunch.cpulist import CpuListError, format_cpulist, parse_cpulist, shown
from xlaunch.machine._files import Notes, decimal, join, read_cpulist, read_text, status_fields

CGROUP_MOUNT = "sys/fs/cgroup"
ISOLATED = "sys/devices/system/cpu/isolated"


@record
class Limits:
    allowed_cpus: tuple[int, ...]
    allowed_mems: tuple[int, ...]
    cpu_budget: Optional[float]
    isolated_cpus: tuple[int, ...] = ()


def read_limits(
    root: str,
    live: bool,
    online_cpus: Iterable[int],
    memory_nodes: Iterable[int],
    notes: Notes,
) -> Limits:
    online = tuple(sorted(online_cpus))
    status_text = read_text(join(root, "proc/self/status"), notes=notes)
    status = status_fields(status_text) if status_text is not None else None
    if status_text is None:
        notes.add("proc/self/status unreadable; allowed CPUs/memory nodes assumed unrestricted")

    if live:
        allowed = tuple(sorted(os.sched_getaffinity(0)))
    else:
        allowed = _allowed_cpus(status, online, notes)
    mems = _listed(status, "Mems_allowed_list", notes)
    if not mems:
        if mems == ():
            notes.add("proc/self/status Mems_allowed_list is empty; assumed every node with memory")
        mems = tuple(sorted(memory_nodes))
    isolated = tuple(c for c in read_cpulist(join(root, ISOLATED), notes) or () if c in set(online))
    outside = sorted(set(isolated) - set(allowed))
    if outside:
        notes.add(f"CPUs {format_cpulist(outside)} are isolated (isolcpus=) and not in this process's "
                  f"affinity: used only where --cores-list names them")
    return Limits(allowed_cpus=allowed, allowed_mems=mems, cpu_budget=read_cpu_budget(root, notes),
                  isolated_cpus=isolated)


def fallback_cpus(root: str, live: bool) -> tuple[int, ...]:
    """CPUs to assume when sysfs lists none: the affinity (live), else Cpus_allowed_list, else 0."""
    if live and hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    text = read_text(join(root, "proc/self/status"))
    listed = _listed(status_fields(text), "Cpus_allowed_list", Notes()) if text else None
    return listed or (0,)


def _allowed_cpus(status: Optional[dict[str, str]], online: tuple[int, ...], notes: Notes) -> tuple[int, ...]:
    listed = _listed(status, "Cpus_allowed_list", notes)
    if listed is None:
        return online
    online_set = set(online)
    allowed = tuple(c for c in listed if c in online_set)
    if not allowed:
        notes.add("Cpus_allowed_list names no online CPU; assumed all online CPUs")
        return online
    return allowed


def _listed(status: Optional[dict[str, str]], key: str, notes: Notes) -> Optional[tuple[int, ...]]:
    """``key`` of a read ``proc/self/status`` (None: it was unreadable, already noted)."""
    if status is None:
        return None
    text = status.get(key)
    if text is None:
        notes.add(f"proc/self/status has no {key}; assumed unrestricted")
        return None
    try:
        return parse_cpulist(text)
    except CpuListError as exc:
        notes.add(f"proc/self/status {key}: {exc}; assumed unrestricted")
        return None


def read_cpu_budget(root: str, notes: Notes) -> Optional[float]:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its ancestors; None: none."""
    text = read_text(join(root, "proc/self/cgroup"), notes=notes)
    if text is None:
        notes.add("proc/self/cgroup unreadable; CPU budget unknown")
        return None
    budgets: list[float] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            budgets += _walk(root, path, ("", "unified"), _v2_quota, notes)
        elif "cpu" in controllers.split(","):
            names = controllers.split(",")
            mounts = tuple(dict.fromkeys([",".join(names), ",".join(reversed(names)), "cpu"]))
            budgets += _walk(root, path, mounts, _v1_quota, notes)
    return min(budgets) if budgets else None


def _walk(root: str, path: str, mounts: tuple[str, ...], quota, notes: Notes) -> list[float]:
    """Quotas of ``path`` and each ancestor, under each candidate mount directory.

    A path with ``..`` (``/../other``: a cgroup outside this process's cgroup namespace) has no
    directory under the mount on its way to the root: none is read (a note), rather than the
    namespace root's or a look-alike's quota."""
    if ".." in path.split("/"):
        notes.add(f"proc/self/cgroup: {shown(path)} is outside this cgroup namespace; its CPU quota is unknown")
        return []
    parts = [p for p in path.split("/") if p]
    found: list[float] = []
    for mount in mounts:
        base = join(root, CGROUP_MOUNT if not mount else f"{CGROUP_MOUNT}/{mount}")
        if not os.path.isdir(base):
            continue
        for depth in range(len(parts), -1, -1):
            value = quota(os.path.join(base, *parts[:depth]), notes)
            if value is not None:
                found.append(value)
    return found


def _v2_quota(directory: str, notes: Notes) -> Optional[float]:
    """``cpu.max`` is ``"<quota> <period>"`` or ``"max <period>"`` (no limit)."""
    path = os.path.join(directory, "cpu.max")
    text = read_text(path, notes=notes)
    if text is None:
        return None
    fields = text.split()
    if len(fields) == 2 and fields[0] == "max" and decimal(fields[1]):
        return None
    quota, period = (decimal(fields[0]), decimal(fields[1])) if len(fields) == 2 else (None, None)
    return _ratio(quota, period, path, text, notes)


def _v1_quota(directory: str, notes: Notes) -> Optional[float]:
    """``cpu.cfs_quota_us`` (``-1``: no limit) over ``cpu.cfs_period_us``."""
    path = os.path.join(directory, "cpu.cfs_quota_us")
    quota_text = read_text(path, notes=notes)
    period_text = read_text(os.path.join(directory, "cpu.cfs_period_us"), notes=notes)
    if quota_text is None or period_text is None or quota_text == "-1":
        return None
    return _ratio(decimal(quota_text), decimal(period_text), path, f"{quota_text} / {period_text}", notes)


def _ratio(quota: Optional[int], period: Optional[int], path: str, text: str, notes: Notes) -> Optional[float]:
    """quota / period in CPUs; a note and None for anything the kernel would not write (0 included:
    the kernel's smallest quota is 1 ms)."""
    if not quota or not period:
        notes.add(f"{path}: {shown(text)} is not a CPU quota; ignored")
        return None
    return quota / period
