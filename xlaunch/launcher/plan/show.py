"""How a plan is printed for people (``--dry-run``, ``-v``); ``Plan.to_json`` is the machine form."""
from __future__ import annotations

import os
import sys

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Mapping, Sequence


def message_lines(notes: Sequence[str], warnings: Sequence[str]) -> str:
    """The options' notes and the plan's warnings as xlaunch prints them on stderr, one line each."""
    return "".join([*(f"xlaunch: note: {note}\n" for note in notes),
                    *(f"xlaunch: warning: {warning}\n" for warning in warnings)])


def format_plan(the_plan: Any, environ: Mapping[str, str], *, verbose: bool = False) -> str:
    """The plan for people: one line per instance, then what the environment gets."""
    import shlex

    from xlaunch.cpulist import format_cpulist

    lines: list[str] = []
    summary = the_plan.machine_summary
    count = len(the_plan.instances)
    head = f"xlaunch plan: {count} instance{'s' if count != 1 else ''}"
    if summary:
        head += _describe_machine(summary)
    lines.append(head)
    for inst in the_plan.instances:
        mem = format_cpulist(inst.mem_nodes) or "-"
        lines.append(
            f"  [{inst.index}] cpus {format_cpulist(inst.cpus)} ({len(inst.cpus)})  "
            f"mem nodes {mem}  bind {inst.bind}/{inst.membind}"
        )
    if the_plan.idle_cpus:
        lines.append(f"  idle cpus: {format_cpulist(the_plan.idle_cpus)}")
    for server in the_plan.import_servers:
        lines.append(f"  shared imports: {', '.join(server.modules)} imported once on cpus "
                     f"{format_cpulist(server.cpus)}, mem nodes {format_cpulist(server.mem_nodes) or '-'}; "
                     f"instances {format_cpulist(server.indices)} forked from it")
    if the_plan.env_set:
        lines.append("  environment (every instance):")
        for name, value in sorted(the_plan.env_set.items()):
            lines.append(f"    {name}={value}")
    per_instance = sorted(
        {name for inst in the_plan.instances for name in inst.env if name not in the_plan.env_set
         and inst.env.get(name) != environ.get(name)}
    )
    for inst in the_plan.instances if per_instance else ():
        values = " ".join(f"{n}={shlex.quote(inst.env[n])}" for n in per_instance if n in inst.env)
        lines.append(f"  [{inst.index}] {values}")
    if the_plan.env_kept:
        kept = ", ".join(f"{k}={v}" for k, v in sorted(the_plan.env_kept.items()))
        lines.append(f"  kept from your environment: {kept}")
    if the_plan.instances and the_plan.instances[0].argv:
        shown = the_plan.instances if verbose else the_plan.instances[:1]
        for inst in shown:
            lines.append(f"  [{inst.index}] argv: {shlex.join(inst.argv)}")
    return "\n".join(lines) + "\n"


def _describe_machine(summary: Mapping[str, Any]) -> str:
    """`` on 112 cores, 224 allowed CPUs (0-223), NUMA nodes 0-1`` from the machine summary."""
    from xlaunch.cpulist import format_cpulist

    parts = []
    if summary.get("cores") is not None:
        parts.append(f"{summary['cores']} cores")
    if summary.get("cpus_allowed") is not None:
        allowed = f"{summary['cpus_allowed']} allowed CPUs"
        if summary.get("allowed_cpulist"):
            allowed += f" ({summary['allowed_cpulist']})"
        parts.append(allowed)
    nodes = summary.get("nodes")
    if isinstance(nodes, (list, tuple)) and nodes:
        parts.append(f"NUMA node{'s' if len(nodes) > 1 else ''} {format_cpulist(nodes)}")
    if summary.get("hybrid"):
        parts.append("hybrid")
    if summary.get("cpu_budget") is not None:
        parts.append(f"CPU budget {summary['cpu_budget']:g}")
    return " on " + ", ".join(parts) if parts else ""


def write_page(text: str, flag: str) -> int:
    """Write the page a command is for to stdout: 0, or 1 with one line naming ``flag`` when it does not
    arrive (a full disk, no reader): the page is the whole job, never a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        return page_lost(flag, exc)
    return 0


def page_lost(flag: str, exc: OSError) -> int:
    """1, with one line saying the page of ``flag`` did not arrive; nothing more goes to stdout (nor at exit)."""
    sys.stderr.write(f"xlaunch: error: {flag}: cannot write to stdout: {exc.strerror or exc}\n")
    sys.stdout = open(os.devnull, "w")     # noqa: SIM115
    return 1
