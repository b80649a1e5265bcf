"""Host settings that change CPU performance, read under the machine root, with advice.

:func:`read_host` reads (``<root>`` is ``XLAUNCH_FSROOT``, default ``/``):

* transparent huge pages: the bracketed word of ``<root>/sys/kernel/mm/transparent_hugepage/``
  ``enabled`` and ``defrag``;
* the CPU frequency governor of each online CPU: ``<root>/sys/devices/system/cpu/cpuN/cpufreq/``
  ``scaling_governor`` (``none`` when ``cpu/cpufreq`` has no ``policyN``: no frequency driver,
  as in most VMs);
* automatic NUMA balancing: ``<root>/proc/sys/kernel/numa_balancing``;
* SMT: ``<root>/sys/devices/system/cpu/smt/control`` and ``active``.

A missing or odd file is ``unknown``, never an error. :func:`host_checks` turns the facts into
one line of advice each where it matters for pinned PyTorch instances.
"""
from __future__ import annotations

import os
from collections import Counter

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Iterable, Optional

from xlaunch._records import record
from xlaunch.machine._files import join, list_numbered, read_text
from xlaunch.machine.model import Host

UNKNOWN = "unknown"
NO_CPUFREQ = "none"
THP_DIR = "sys/kernel/mm/transparent_hugepage"
CPU_DIR = "sys/devices/system/cpu"
NUMA_BALANCING = "proc/sys/kernel/numa_balancing"
NUMA_BALANCING_MODES = {"0": "disabled", "1": "enabled", "2": "memory tiering only", "3": "enabled + memory tiering"}
SMT_CONTROLS = ("on", "off", "forceoff", "notsupported", "notimplemented")


def read_host(root: str, online_cpus: Iterable[int]) -> Host:
    """The host settings under ``root``; ``online_cpus`` are the CPUs whose governor counts."""
    smt_active = read_text(join(root, f"{CPU_DIR}/smt/active"))
    return Host(
        thp_enabled=bracketed(read_text(join(root, f"{THP_DIR}/enabled"))),
        thp_defrag=bracketed(read_text(join(root, f"{THP_DIR}/defrag"))),
        governors=_governors(root, online_cpus),
        numa_balancing=_numa_balancing(read_text(join(root, NUMA_BALANCING))),
        smt_control=_word(read_text(join(root, f"{CPU_DIR}/smt/control")), SMT_CONTROLS),
        smt_active={"1": True, "0": False}.get(smt_active or ""),
    )


def bracketed(text: Optional[str]) -> str:
    """The selected word of a sysfs choice file (``always [madvise] never`` -> ``madvise``)."""
    if text is None:
        return UNKNOWN
    start, end = text.find("["), text.find("]")
    if start < 0 or end <= start + 1:
        return UNKNOWN
    return text[start + 1:end]


def _governors(root: str, online_cpus: Iterable[int]) -> tuple[tuple[str, int], ...]:
    """(governor, number of CPUs), most common first.

    Without ``cpu/cpufreq`` (a recording without cpufreq files, a kernel without cpufreq): ()
    for unknown. With it but no ``policyN`` in it (no frequency driver, as in most VMs), or for
    a CPU without ``cpuN/cpufreq``: ``none``.
    """
    cpu_dir = join(root, CPU_DIR)
    cpus = list(online_cpus) or list_numbered(cpu_dir, "cpu")
    cpufreq = join(cpu_dir, "cpufreq")
    if not cpus or not os.path.isdir(cpufreq):
        return ()
    if not list_numbered(cpufreq, "policy"):
        return ((NO_CPUFREQ, len(cpus)),)
    counts: Counter[str] = Counter()
    for cpu in cpus:
        governor = read_text(join(cpu_dir, f"cpu{cpu}/cpufreq/scaling_governor"))
        if governor:
            counts[governor] += 1
        elif os.path.isdir(join(cpu_dir, f"cpu{cpu}/cpufreq")):
            counts[UNKNOWN] += 1
        else:
            counts[NO_CPUFREQ] += 1
    return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _numa_balancing(text: Optional[str]) -> str:
    return text if text in NUMA_BALANCING_MODES else UNKNOWN


def _word(text: Optional[str], allowed: tuple[str, ...]) -> str:
    return text if text in allowed else UNKNOWN


def governor_summary(host: Host) -> str:
    """One governor name, ``none`` (no cpufreq), ``unknown``, or ``mixed``."""
    if not host.governors:
        return UNKNOWN
    if len(host.governors) == 1:
        return host.governors[0][0]
    return "mixed"


@record
class HostCheck:
    """One host setting as shown by ``--show-topology``."""

    name: str                 # transparent_hugepage | cpufreq_governor | numa_balancing | smt
    value: str                # readable value, e.g. "enabled madvise, defrag madvise"
    advice: Optional[str]     # one line, only where the setting matters


def host_checks(host: Host, cpu_nodes: int = 1) -> list[HostCheck]:
    """The four host checks; ``cpu_nodes`` is the number of NUMA nodes that have CPUs."""
    return [_thp_check(host), _governor_check(host), _numa_balancing_check(host, cpu_nodes), _smt_check(host)]


def _thp_check(host: Host) -> HostCheck:
    advice = None
    if host.thp_enabled == "never":
        advice = ("huge pages are off: large tensors use 4 KiB pages and miss the TLB more; "
                  "'madvise' (torch asks with THP_MEM_ALLOC_ENABLE=1) or 'always' lets them use 2 MiB pages")
    elif host.thp_enabled == "madvise":
        advice = "only memory that asks gets huge pages: set THP_MEM_ALLOC_ENABLE=1 so torch asks for its tensors"
    elif host.thp_defrag == "always":
        advice = "defrag 'always' can stall allocations on direct compaction; 'defer+madvise' or 'madvise' avoid it"
    return HostCheck("transparent_hugepage", f"enabled {host.thp_enabled}, defrag {host.thp_defrag}", advice)


def _governor_check(host: Host) -> HostCheck:
    summary = governor_summary(host)
    if summary == "mixed":
        value = "mixed: " + ", ".join(f"{name} ({count} CPUs)" for name, count in host.governors)
    elif summary == NO_CPUFREQ:
        value = "none (no cpufreq: the hypervisor or firmware sets the frequency)"
    else:
        value = summary
    slow = [name for name, _ in host.governors if name not in ("performance", NO_CPUFREQ, UNKNOWN)]
    advice = None
    if slow:
        advice = (f"governor {', '.join(slow)} lowers the clock between bursts: 'performance' gives steadier, "
                  f"faster runs (cpupower frequency-set -g performance)")
    return HostCheck("cpufreq_governor", value, advice)


def _numa_balancing_check(host: Host, cpu_nodes: int) -> HostCheck:
    mode = host.numa_balancing
    value = UNKNOWN if mode == UNKNOWN else f"{NUMA_BALANCING_MODES[mode]} ({mode})"
    advice = None
    if mode in ("1", "3") and cpu_nodes > 1:
        advice = ("the kernel migrates pages and tasks of instances that xlaunch already binds to their nodes; "
                  "consider sysctl kernel.numa_balancing=0")
    return HostCheck("numa_balancing", value, advice)


def _smt_check(host: Host) -> HostCheck:
    active = {True: "active", False: "inactive", None: "active unknown"}[host.smt_active]
    advice = None
    if host.smt_active:
        advice = ("two CPUs share each core: xlaunch uses one CPU per core unless --use-logical-cores "
                  "(siblings share one core's vector units)")
    return HostCheck("smt", f"{host.smt_control}, {active}", advice)


def host_json(host: Host, cpu_nodes: int = 1) -> dict[str, dict[str, object]]:
    """The ``host`` object of ``--show-topology --json``."""
    checks = {check.name: check for check in host_checks(host, cpu_nodes)}
    return {
        "transparent_hugepage": {"enabled": host.thp_enabled, "defrag": host.thp_defrag,
                                 "advice": checks["transparent_hugepage"].advice},
        "cpufreq_governor": {"value": governor_summary(host), "cpus": dict(host.governors),
                             "advice": checks["cpufreq_governor"].advice},
        "numa_balancing": {"value": host.numa_balancing,
                           "meaning": NUMA_BALANCING_MODES.get(host.numa_balancing, UNKNOWN),
                           "advice": checks["numa_balancing"].advice},
        "smt": {"control": host.smt_control, "active": host.smt_active, "advice": checks["smt"].advice},
    }
