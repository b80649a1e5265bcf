"""What the runner tells: the plan for its log, instances observed while they run (:mod:`..observe`), the
warnings where that differs from the plan, the kernels oneDNN ran (``--kernel-report``), and the
summary table and JSON."""
from __future__ import annotations

import os

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional, Sequence

    from xlaunch.launcher.observe.kernel_filter import VerboseFilter
    from xlaunch.launcher.plan.records import Plan
    from xlaunch.launcher.run.child import Child
    from xlaunch.launcher.run.logfiles import LogFiles

OBSERVE_AFTER = 0.25         # an instance is observed once it has run this long


def plan_lines(plan: Plan, *, keep_going: bool, grace: float) -> list[str]:
    """The plan as the launcher log records it, before anything starts."""
    import os
    import shlex

    from xlaunch.cpulist import format_cpulist

    lines = [f"xlaunch pid {os.getpid()}: {len(plan.instances)} instance(s), "
             f"keep_going={keep_going}, grace_period={grace:g}s"]
    if plan.machine_summary:
        lines.append(f"machine: {plan.machine_summary}")
    for instance in plan.instances:
        lines.append(f"instance {instance.index}: cpus {format_cpulist(instance.cpus) or '-'}, "
                     f"mem nodes {format_cpulist(instance.mem_nodes) or '-'}, bind {instance.bind}, "
                     f"membind {instance.membind}, argv {shlex.join(instance.argv)}")
    if plan.kernel_report:
        lines.append("kernel report: oneDNN's verbose lines are taken out of each instance's output")
    if plan.idle_cpus:
        lines.append(f"idle cpus: {format_cpulist(plan.idle_cpus)}")
    for server in plan.import_servers:
        lines.append(f"shared imports: {','.join(server.modules)} on cpus {format_cpulist(server.cpus)}, mem nodes "
                     f"{format_cpulist(server.mem_nodes) or '-'} ({server.membind}), forks instances "
                     f"{format_cpulist(server.indices)}")
    lines += [f"env set: {name}={value}" for name, value in sorted(plan.env_set.items())]
    lines += [f"env kept (user's value): {name}={value}" for name, value in sorted(plan.env_kept.items())]
    lines += [f"plan warning: {warning}" for warning in plan.warnings]
    return lines


def observe(children: Sequence[Child], now: float) -> Optional[float]:
    """Sample running instances; return when the next sample is due.

    The module is imported, and an instance observed, only once it has run ``OBSERVE_AFTER``
    seconds: programs shorter than that pay nothing.
    """
    due: list[float] = []
    for child in children:
        if not child.running:
            continue
        if child.observer is None:
            if now - child.started < OBSERVE_AFTER:
                due.append(child.started + OBSERVE_AFTER)
                continue
            from xlaunch.launcher.observe.observer import Observer

            child.observer = Observer(child.pid, mem_nodes=child.instance.mem_nodes)
        child.observer.poll(now)
        due.append(child.observer.next_due)
    return min(due) if due else None


def with_engine_record(runner: Any, child: Child) -> Any:
    """The instance to start: with ``--auto-optimize``, its environment also names the file where it
    records the engine each model runs (``XLAUNCH_AUTO_OPTIMIZE_RECORD``, in a private folder the
    runner removes at the end), read into the summary (:func:`results`)."""
    instance = child.instance
    if "XLAUNCH_AUTO_OPTIMIZE" not in instance.env:   # xlaunch.kernels.inject.DTYPE_ENV: not an --auto-optimize run
        return instance
    import tempfile

    from xlaunch._records import replace
    from xlaunch.kernels.inject import RECORD_ENV

    if runner.records is None:
        try:
            runner.records = tempfile.mkdtemp(prefix="xlaunch-engines-")
        except OSError:
            return instance
    child.engines = os.path.join(runner.records, f"instance-{instance.index}.jsonl")
    return replace(instance, env={**instance.env, RECORD_ENV: child.engines})


def kernel_filter(logs: Optional[LogFiles], index: int) -> VerboseFilter:
    """``--kernel-report``: the filter of instance ``index``'s stream (raw lines to its oneDNN log)."""
    from xlaunch.launcher.observe.kernel_filter import VerboseFilter

    return VerboseFilter(raw=logs.onednn.get(index) if logs is not None else None)


def _requested_dtype(child: Child) -> Optional[str]:
    """What the instance's program was asked to compute in (``--auto-optimize --dtype``), if anything."""
    from xlaunch.kernels.inject import DTYPE_ENV

    return child.instance.env.get(DTYPE_ENV)


def kernel_warnings(children: Sequence[Child]) -> list[str]:
    """``--kernel-report`` findings in plain words, one line each, prefixed with the instance."""
    from xlaunch.launcher.observe.kernel_report import kernel_warnings as judge

    warnings = []
    for child in children:
        if child.kernels is None or child.proc is None:
            continue
        index = child.instance.index
        for warning in judge(child.kernels.tally.to_json(), _requested_dtype(child)):
            warnings.append(f"instance {index}: {warning}")
        if child.kernels.raw_error is not None:
            error = child.kernels.raw_error
            warnings.append(f"instance {index}: its oneDNN log stopped ({error.strerror or error}); "
                            "the report still counts every line")
    return warnings


def observation_warnings(children: Sequence[Child], plan: Plan) -> list[str]:
    """Where what ran differs from the plan (and, with ``--kernel-report``, what the kernels say),
    one line per finding."""
    if all(child.observer is None for child in children):
        return kernel_warnings(children)
    from xlaunch.launcher.observe.observer import compare

    warnings = []
    for child in children:
        if child.observer is None:
            continue
        instance = child.instance
        planned_cpus = instance.cpus if instance.bind != "none" else ()
        for warning in compare(child.observer.observed, planned_cpus, instance.mem_nodes, plan.allocator, plan.openmp):
            warnings.append(f"instance {instance.index}: {warning}")
    return warnings + kernel_warnings(children)


def results(children: Sequence[Child]) -> list:
    """One :class:`~xlaunch.launcher.observe.summary.InstanceResult` per instance."""
    from xlaunch.launcher.observe.summary import InstanceResult

    out = []
    for c in children:
        observed = cells = None
        if c.observer is not None:
            from xlaunch.launcher.observe.observer import cells as observed_cells, to_json

            observed, cells = to_json(c.observer.observed), observed_cells(c.observer.observed)
        if c.kernels is not None and c.proc is not None:
            observed = {**(observed or {}), "kernels": c.kernels.tally.to_json()}
        engines = None
        if c.engines is not None:
            from xlaunch.kernels.inject import read_records

            engines = read_records(c.engines)
        out.append(InstanceResult(
            index=c.instance.index, cpus=c.instance.cpus, mem_nodes=c.instance.mem_nodes,
            status=c.status,
            text=c.text + (f" ({c.stopped_by})" if c.stopped_by and c.status else ""),
            wall_s=(c.ended - c.started) if c.ended is not None and c.started else None,
            observed=observed, cells=cells, engines=engines,
        ))
    return out


def summary(children: Sequence[Child], plan: Plan, code: int, *, json: bool,
            noun: str = "instance") -> tuple[list[str], Optional[dict[str, Any]]]:
    """The summary table's lines, and the ``--summary-json`` document when ``json``."""
    from xlaunch.launcher.observe import summary as tables

    rows = results(children)
    data = tables.summary_json(rows, code, allocator=plan.allocator, openmp=plan.openmp) if json else None
    return tables.table_lines(rows, code, noun), data
