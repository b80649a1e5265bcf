"""Human and JSON views of the machine model: ``--show-topology`` and ``--check-isa``.

Pure functions of a :class:`~xlaunch.machine.Machine`; only
``isa_report(..., with_torch=True)`` imports torch, inside that branch.
"""
from __future__ import annotations

import os
import re
from collections import Counter

TYPE_CHECKING = False   # typing stays off the launch path (docs/launcher.md, "Start-up cost")
if TYPE_CHECKING:
    from typing import Any, Optional

from xlaunch._isa_levels import kernel_levels, multiplies_bf16
from xlaunch.cpulist import format_cpulist
from xlaunch.machine.host import host_checks, host_json
from xlaunch.machine.isa import ISA_FLAGS, ONEDNN_CEILING_ENV, onednn_flags
from xlaunch.machine.model import Machine


def topology_json(machine: Machine) -> dict[str, Any]:
    """The whole machine model as JSON-ready data (``--show-topology --json``)."""
    return {
        "root": machine.root,
        "cpus": [
            {"id": c.id, "online": c.online, "package": c.package, "die": c.die, "core_id": c.core_id,
             "siblings": list(c.siblings), "node": c.node, "l3": c.l3, "kind": c.kind}
            for c in machine.cpus
        ],
        "online_cpus": list(machine.online_cpus),
        "cores": [
            {"index": k.index, "cpus": list(k.cpus), "package": k.package, "node": k.node,
             "l3": k.l3, "kind": k.kind}
            for k in machine.cores
        ],
        "nodes": [
            {"id": n.id, "cpus": list(n.cpus), "cpulist": format_cpulist(n.cpus),
             "distances": {str(other): d for other, d in n.distances}, "memory_kib": n.memory_kib}
            for n in machine.nodes
        ],
        "l3_domains": [
            {"index": d.index, "cpus": list(d.cpus), "cpulist": format_cpulist(d.cpus), "size_kib": d.size_kib}
            for d in machine.l3_domains
        ],
        "core_types": dict(Counter(k.kind for k in machine.cores)),
        "hybrid": machine.is_hybrid,
        "allowed_cpus": list(machine.allowed_cpus),
        "allowed_cpulist": format_cpulist(machine.allowed_cpus),
        "allowed_mems": list(machine.allowed_mems),
        "cpu_budget": machine.cpu_budget,
        "isolated_cpus": list(machine.isolated_cpus),
        "isa": _isa_flags(machine),
        "libraries": [{"kind": lib.kind, "path": lib.path, "source": lib.source} for lib in machine.libraries],
        "host": host_json(machine.host, _cpu_nodes(machine)),
        "notes": list(machine.notes),
    }


def machine_summary(machine: Machine) -> dict[str, Any]:
    """The few facts a plan records (``Plan.machine_summary``)."""
    first: dict[str, str] = {}
    for lib in machine.libraries:
        first.setdefault(lib.kind, lib.path)
    return {
        "cpus_online": len(machine.online_cpus),
        "cpus_allowed": len(machine.allowed_cpus),
        "allowed_cpulist": format_cpulist(machine.allowed_cpus),
        "nodes": [n.id for n in machine.nodes],
        "cores": len(machine.cores),
        "hybrid": machine.is_hybrid,
        "cpu_budget": machine.cpu_budget,
        "libraries": first,
    }


def format_topology(machine: Machine) -> str:
    """A readable ``--show-topology`` page."""
    out: list[str] = []
    online = machine.online_cpus
    offline = [c.id for c in machine.cpus if not c.online]
    packages = sorted({c.package for c in machine.cpus if c.package is not None})
    out.append(f"Machine root: {machine.root}")
    out.append(f"CPUs: {len(machine.cpus)} present, {len(online)} online ({format_cpulist(online) or '-'})"
               + (f", offline: {format_cpulist(offline)}" if offline else ""))
    out.append(f"Packages: {len(packages)}   Physical cores: {len(machine.cores)}")
    if machine.isa.model_name:
        out.append(f"Model: {machine.isa.model_name}")
    out.append("")
    out.append("NUMA nodes:")
    for node in machine.nodes:
        memory = "memory unknown" if node.memory_kib is None else f"{node.memory_kib / 1048576:.1f} GiB"
        cpus = format_cpulist(node.cpus) if node.cpus else "no CPUs (memory only)"
        distances = " ".join(f"{other}:{d}" for other, d in node.distances)
        out.append(f"  node {node.id:>3}: cpus {cpus}; {memory}" + (f"; distances {distances}" if distances else ""))
    out.append("")
    out.append("L3 domains:")
    if not machine.l3_domains:
        out.append("  (unknown)")
    for domain in machine.l3_domains:
        size = "" if domain.size_kib is None else f" ({_kib(domain.size_kib)})"
        out.append(f"  L3 {domain.index}: cpus {format_cpulist(domain.cpus)}{size}")
    out.append("")
    kinds = Counter(k.kind for k in machine.cores)
    out.append("Core types: " + ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
               + (" (hybrid)" if machine.is_hybrid else ""))
    out.append("Cores (index: cpus [node, L3, package, kind]):")
    for core in machine.cores:
        out.append(f"  {core.index:>4}: {format_cpulist(core.cpus):<12} [node {_dash(core.node)}, "
                   f"L3 {_dash(core.l3)}, package {_dash(core.package)}, {core.kind}]")
    out.append("")
    out.append(f"Allowed CPUs: {format_cpulist(machine.allowed_cpus) or '-'} ({len(machine.allowed_cpus)})")
    if machine.isolated_cpus:
        out.append(f"Isolated CPUs (isolcpus=): {format_cpulist(machine.isolated_cpus)}")
    out.append(f"Allowed memory nodes: {format_cpulist(machine.allowed_mems) or '-'}")
    out.append("CPU budget: " + ("unlimited" if machine.cpu_budget is None
                                 else f"{machine.cpu_budget:g} CPUs (cgroup quota)"))
    out.append("")
    out.append("Libraries:")
    if not machine.libraries:
        out.append("  (none found)")
    for lib in machine.libraries:
        out.append(f"  {lib.kind:<17} {lib.path}  [{lib.source}]")
    out.append("")
    out.append("Host:")
    for check in host_checks(machine.host, _cpu_nodes(machine)):
        out.append(f"  {_HOST_TITLES[check.name] + ':':<26} {check.value}")
        if check.advice:
            out.append(f"  {'':<26} advice: {check.advice}")
    if machine.notes:
        out.append("")
        out.append("Notes:")
        out.extend(f"  - {note}" for note in machine.notes)
    return "\n".join(out)


def _kib(size: int) -> str:
    """``32768`` -> ``32 MiB``; a size that is not whole MiB in KiB (``1536 KiB``, not ``1 MiB``)."""
    return f"{size // 1024} MiB" if size % 1024 == 0 else f"{size} KiB"


def isa_report(machine: Machine, with_torch: bool = False,
               environ: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """``--check-isa --json``: the flags, AMX permission, dtype advice (under the ``ONEDNN_MAX_CPU_ISA``
    of ``environ``, default this process's), and torch's view if asked."""
    isa = machine.isa
    report: dict[str, Any] = {
        "isa": _isa_flags(machine),
        "vendor": isa.vendor,
        "model_name": isa.model_name,
        "amx_permitted": isa.amx_permitted,
        "advice": dtype_advice(machine, environ),
        "kernels": kernel_levels(isa.flags),
    }
    if with_torch:
        report["torch"] = torch_report()
    return report


def dtype_advice(machine: Machine, environ: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """Which dtypes have fast matrix instructions here, and the reason. Under oneDNN's ceiling
    (``ONEDNN_MAX_CPU_ISA=AVX2``...) the bf16, fp16 and int8 verdicts are those of the flags it leaves
    to oneDNN, and a verdict the ceiling changed says so."""
    capped = onednn_flags(machine.isa.flags, environ)
    if capped == machine.isa.flags:
        return _advice(machine, machine.isa.flags)
    env = os.environ if environ is None else environ
    ceiling = next(f"{name}={env[name].strip()}" for name in ONEDNN_CEILING_ENV if env.get(name))
    free, advice = _advice(machine, machine.isa.flags), _advice(machine, capped)
    advice["fp32"] = free["fp32"]        # torch's fp32 GEMMs are MKL's, which the ceiling does not cap
    for dtype, verdict in advice.items():
        if verdict != free[dtype]:
            verdict["why"] += f" (under {ceiling}; the CPU has: {free[dtype]['why']})"
    return advice


def _advice(machine: Machine, flags: frozenset[str]) -> dict[str, dict[str, Any]]:
    has = flags.__contains__
    amx_usable = machine.isa.amx_permitted is not False
    amx_note = "" if machine.isa.amx_permitted is not False else " (AMX present but not granted to this process)"

    def verdict(paths: list[tuple[str, bool]], fallback: str) -> dict[str, Any]:
        for why, ok in paths:
            if ok:
                return {"fast": True, "why": why}
        return {"fast": False, "why": fallback}

    amx_blocked = has("amx_tile") and not amx_usable
    return {
        "fp32": verdict([("AVX-512 FMA (avx512f)", has("avx512f")), ("AVX2 + FMA", has("avx2") and has("fma"))],
                        "no AVX2/FMA: fp32 runs on SSE paths"),
        "bf16": verdict([("AMX-BF16 tiles", has("amx_bf16") and amx_usable),
                         ("AVX512_BF16 dot products", has("avx512_bf16"))],
                        "no AMX_BF16 or AVX512_BF16: bf16 math goes through fp32 conversions (usually no faster than fp32)"
                        + (amx_note if amx_blocked else "")),
        "fp16": verdict([("AMX-FP16 tiles", has("amx_fp16") and amx_usable),
                         ("AVX512_FP16 arithmetic", has("avx512_fp16"))],
                        "no AMX_FP16 or AVX512_FP16: fp16 is emulated through fp32"),
        "int8": verdict([("AMX-INT8 tiles", has("amx_int8") and amx_usable),
                         ("AVX512_VNNI dot products", has("avx512_vnni")),
                         ("AVX_VNNI (256-bit) dot products", has("avx_vnni")),
                         # oneDNN's AVX2 int8 kernels (vpmaddubsw+vpmaddwd+vpaddd per step) still beat fp32:
                         # static INT8 measured 1.5x fp32 GEMM, 1.5-1.9x conv on an AVX2-only EPYC VM
                         ("AVX2 integer multiply-adds, no VNNI (3 instructions a step): static INT8 measured "
                          "~1.5x fp32 on an AVX2-only EPYC; --probe measures it here", has("avx2"))],
                        "no AMX_INT8, VNNI or AVX2: int8 matmuls run on SSE paths, rarely faster than fp32"
                        + (amx_note if amx_blocked else "")),
    }


def apply_measurements(report: dict[str, Any], measured: dict[str, dict[str, Any]]) -> None:
    """Let measured verdicts (``--probe``: ``{"bf16": {"mark", "ratio", "route", "verdict"}}``)
    decide the dtype table: one verdict per dtype, the flags' reason kept after it."""
    for dtype, found in measured.items():
        advice = report["advice"].get(dtype)
        if advice is None:
            continue
        flags = advice["why"]
        report["advice"][dtype] = {
            "fast": found["mark"] == "yes",
            "mark": found["mark"],
            "measured_vs_fp32": found["ratio"],
            "why": f"measured {found['ratio']:.2f}x fp32 ({found['route']}): {found['verdict']}; "
                   f"the flags alone said {'fast' if advice['fast'] else 'not fast'}: {flags}",
        }


def torch_report() -> dict[str, Any]:
    """What the installed torch sees (imports torch; only for ``--check-isa --torch``)."""
    try:
        import torch
    except ImportError as exc:
        return {"available": False, "error": str(exc)}
    config = torch.__config__.show()
    return {
        "available": True,
        "version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "onednn_version": _search(r"MKL-DNN v([\w.]+)", config),
        "mkl_available": torch.backends.mkl.is_available(),
        "mkl_version": _search(r"Math Kernel Library Version ([\w.\-]+)", config),
    }


def format_isa(report: dict[str, Any]) -> str:
    """A readable ``--check-isa`` table from :func:`isa_report`'s output."""
    out = []
    if report.get("model_name") or report.get("vendor"):
        out.append(f"CPU: {report.get('model_name') or '?'} ({report.get('vendor') or '?'})")
    flags = report["isa"]
    width = max(len(f) for f in flags) if flags else 8
    out.append(f"{'flag':<{width}}  present")
    for flag, present in flags.items():
        out.append(f"{flag:<{width}}  {'yes' if present else 'no'}")
    amx = report.get("amx_permitted")
    out.append("")
    out.append("AMX granted to this process: " + {True: "yes", False: "no", None: "not checked"}[amx])
    kernels = report.get("kernels")
    if kernels is not None:
        cap = f"XLAUNCH_CPU_ISA={kernels['cap']}" if kernels["cap"] else "XLAUNCH_CPU_ISA unset"
        if kernels["error"]:
            out.append(f"xlaunch kernels: {kernels['error']}")
        elif kernels["level"] is None:
            out.append("xlaunch kernels: none for this architecture (pure-torch paths)")
        else:
            each = ", ".join(f"{name} {level}" for name, level in kernels["libraries"].items())
            out.append(f"xlaunch kernels: {kernels['level']} level ({each}; {cap})")
            if report["advice"]["bf16"]["fast"] and not multiplies_bf16(kernels["level"]):
                out.append("  (the CPU has native bf16, the capped kernels do not use it: xlaunch.llm widens bf16 "
                           "to fp32 and defaults to fp32 activations)")
    out.append("")
    out.append("dtype  fast  why")
    for dtype, verdict in report["advice"].items():
        mark = verdict.get("mark") or ("yes" if verdict["fast"] else "no")
        out.append(f"{dtype:<5}  {mark:<4}  {verdict['why']}")
    torch_info = report.get("torch")
    if torch_info is not None:
        out.append("")
        if not torch_info.get("available"):
            out.append(f"torch: not importable ({torch_info.get('error')}); to install it: pip install \"xlaunch[torch]\"")
        else:
            out.append(f"torch {torch_info['version']}: cpu capability {torch_info['cpu_capability']}, "
                       f"oneDNN {torch_info['onednn_version'] or '?'}"
                       f"{'' if torch_info['mkldnn_available'] else ' (unavailable)'}, "
                       f"MKL {torch_info['mkl_version'] or '?'}"
                       f"{'' if torch_info['mkl_available'] else ' (unavailable)'}")
    return "\n".join(out)


def _isa_flags(machine: Machine) -> dict[str, bool]:
    return {flag: machine.isa.has(flag) for flag in ISA_FLAGS}


def _search(pattern: str, text: str) -> Optional[str]:
    match = re.search(pattern, text)
    return match.group(1) if match else None


_HOST_TITLES = {
    "transparent_hugepage": "transparent huge pages",
    "cpufreq_governor": "CPU frequency governor",
    "numa_balancing": "automatic NUMA balancing",
    "smt": "SMT",
}


def _cpu_nodes(machine: Machine) -> int:
    return sum(1 for node in machine.nodes if node.cpus)


def _dash(value: Optional[int]) -> str:
    return "-" if value is None else str(value)
