"""Write the synthetic-but-faithful recorded machines as tests/machines/<name>.tar.xz.

Each tree holds exactly the files (and formats) a Linux 6.x kernel exposes for that machine:
``sys/devices/system/cpu`` (lists, per-CPU ``topology/`` and ``cache/index*``; offline CPUs
have neither, and are missing from every sibling/shared/node list), ``sys/devices/system/node``,
``sys/devices/cpu_core|cpu_atom/cpus`` on hybrid parts, ``proc/cpuinfo`` (one block per
online CPU, real flag lines of the model), ``proc/self/status``, ``proc/self/cgroup``, the
cgroup quota files, and the host settings a tuning check reads: transparent huge pages
(``enabled``/``defrag``), ``proc/sys/kernel/numa_balancing`` (absent on a kernel without NUMA),
``cpu/smt/control|active`` and, on bare metal only, each online CPU's
``cpufreq/scaling_governor`` (a VM has no cpufreq; an offline CPU's policy reads EBUSY).
Archives recorded from real machines with ``xlaunch-record-machine --archive`` live alongside.

Run: ``python tests/machines/make_trees.py`` (rewrites the synthetic archives in place; the
archives are reproducible, so an unchanged machine leaves git clean).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from xlaunch.cpulist import format_cpulist, parse_cpulist  # noqa: E402
from xlaunch.machine.archive import write_archive  # noqa: E402

THP_UBUNTU = ("always [madvise] never", "always defer defer+madvise [madvise] never")
THP_ALWAYS = ("[always] madvise never", "always defer defer+madvise [madvise] never")

# ---------------------------------------------------------------------------- flag lines
SPR_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr "
    "sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good "
    "nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 monitor ds_cpl vmx "
    "smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt "
    "tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb cat_l3 "
    "cat_l2 cdp_l3 invpcid_single intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp ibrs_enhanced tpr_shadow "
    "flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a "
    "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw "
    "avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local "
    "split_lock_detect user_shstk avx_vnni avx512_bf16 wbnoinvd dtherm ida arat pln pts hwp "
    "hwp_act_window hwp_epp hwp_pkg_req vnmi avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes "
    "vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote "
    "movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr ibt amx_bf16 "
    "avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities"
)
VMX_FLAGS = (
    "vnmi preemption_timer posted_intr invvpid ept_x_only ept_ad ept_1gb flexpriority apicv tsc_offset "
    "vtpr mtf vapic ept vpid unrestricted_guest vapic_reg vid ple shadow_vmcs pml ept_mode_based_exec "
    "tsc_scaling usr_wait_pause notify_vm_exiting ipi_virt"
)
MILAN_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 "
    "ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid "
    "extd_apicid aperfmperf rapl pni pclmulqdq monitor ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe "
    "popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm extapic cr8_legacy abm sse4a misalignsse "
    "3dnowprefetch osvw ibs skinit wdt tce topoext perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb "
    "cat_l3 cdp_l3 invpcid_single hw_pstate ssbd mba ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep "
    "bmi2 erms invpcid cqm rdt_a rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves "
    "cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local user_shstk clzero irperf xsaveerptr rdpru "
    "wbnoinvd amd_ppin brs arat npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid "
    "decodeassists pausefilter pfthreshold v_vmsave_vmload vgif v_spec_ctrl umip pku ospke vaes "
    "vpclmulqdq rdpid overflow_recov succor smca fsrm debug_swap"
)
MILAN_VM_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 "
    "ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid "
    "extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes "
    "xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch "
    "osvw topoext ssbd ibrs ibpb stibp vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid "
    "rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr rdpru "
    "wbnoinvd arat npt nrip_save umip pku ospke vaes vpclmulqdq rdpid fsrm"
)
ADL_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr "
    "sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good "
    "nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 monitor ds_cpl vmx "
    "smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes "
    "xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb ssbd ibrs ibpb stibp ibrs_enhanced "
    "tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed "
    "adx smap clflushopt clwb intel_pt sha_ni xsaveopt xsavec xgetbv1 xsaves split_lock_detect "
    "user_shstk avx_vnni dtherm ida arat pln pts hwp hwp_notify hwp_act_window hwp_epp hwp_pkg_req hfi "
    "vnmi umip pku ospke waitpkg gfni vaes vpclmulqdq rdpid movdiri movdir64b fsrm md_clear serialize "
    "pconfig arch_lbr ibt flush_l1d arch_capabilities"
)
CLX_VM_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 "
    "ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid tsc_known_freq pni "
    "pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx "
    "f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced "
    "fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm mpx avx512f avx512dq rdseed adx smap "
    "clflushopt clwb avx512cd avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves arat avx512_vnni md_clear "
    "arch_capabilities"
)
ICX_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr "
    "sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good "
    "nopl xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 "
    "ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes "
    "xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb cat_l3 invpcid_single intel_ppin "
    "ssbd mba ibrs ibpb stibp ibrs_enhanced tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust "
    "bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt "
    "clwb intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc "
    "cqm_occup_llc cqm_mbm_total cqm_mbm_local split_lock_detect wbnoinvd dtherm ida arat pln pts vnmi "
    "avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme "
    "avx512_vpopcntdq la57 rdpid fsrm md_clear pconfig flush_l1d arch_capabilities"
)
CFL_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr "
    "sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good "
    "nopl xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 "
    "ssse3 sdbg fma cx16 xtpr pdcm pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave "
    "avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb ssbd ibrs ibpb stibp tpr_shadow "
    "flexpriority ept vpid ept_ad fsgsbase tsc_adjust sgx bmi1 hle avx2 smep bmi2 erms invpcid rtm mpx "
    "rdseed adx smap clflushopt intel_pt xsaveopt xsavec xgetbv1 xsaves dtherm ida arat pln pts hwp "
    "hwp_notify hwp_act_window hwp_epp vnmi md_clear flush_l1d arch_capabilities"
)


# ---------------------------------------------------------------------------- model of a machine
@dataclass
class CpuSpec:
    id: int
    package: int
    core_id: int
    node: Optional[int]
    l3: int                       # L3 group key
    l2: int                       # L2 group key (also the cluster id)
    online: bool = True
    die: int = 0


@dataclass
class CpuModel:
    vendor: str
    family: int
    model: int
    name: str
    stepping: int
    flags: str
    l1d_kib: int
    l1i_kib: int
    l2_kib: int
    l3_kib: int
    mhz: str = "2000.000"
    vmx: Optional[str] = None
    bugs: str = "spectre_v1 spectre_v2 spec_store_bypass swapgs"
    address_sizes: str = "46 bits physical, 57 bits virtual"


@dataclass
class MachineSpec:
    name: str
    cpu_model: CpuModel
    cpus: list[CpuSpec]
    possible: int                                  # nr_cpu_ids
    nodes: Optional[dict[int, int]] = None         # node id -> MemTotal KiB; None: no node/ dir
    distances: Optional[list[list[int]]] = None
    node_possible: str = "0"
    normal_memory: Optional[list[int]] = None      # has_normal_memory (default: all memory nodes)
    hybrid: Optional[tuple[str, str]] = None       # (cpu_core cpus, cpu_atom cpus)
    cpus_allowed: Optional[str] = None             # Cpus_allowed_list (default: all possible)
    mems_allowed: Optional[str] = None
    cgroup: str = "0::/\n"
    cgroup_files: dict[str, str] = field(default_factory=dict)
    meminfo_kib: Optional[int] = None              # /proc/meminfo MemTotal (no-node machines)
    l2_shared: bool = False                        # cluster (E-core) L2 groups
    thp: tuple[str, str] = THP_UBUNTU              # transparent_hugepage enabled, defrag
    numa_balancing: Optional[int] = 0              # None: kernel without CONFIG_NUMA_BALANCING
    smt: tuple[str, str] = ("on", "1")             # cpu/smt control, active
    governor: Optional[str] = None                 # scaling_governor of each online CPU; None: VM


def mask(ids, nbits: int) -> str:
    """Kernel ``%*pb`` bitmap: 32-bit hex words, most significant first, comma separated."""
    value = 0
    for i in ids:
        value |= 1 << i
    words = []
    for start in range(0, nbits, 32):
        words.append((value >> start) & 0xFFFFFFFF)
    words.reverse()
    first_bits = nbits % 32 or 32
    first_width = (first_bits + 3) // 4
    parts = [f"{words[0]:0{first_width}x}"] + [f"{w:08x}" for w in words[1:]]
    return ",".join(parts)


def write(base: Path, relative: str, text: str) -> None:
    path = base / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")


def build(spec: MachineSpec, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    cpus = {c.id: c for c in spec.cpus}
    online = [c.id for c in spec.cpus if c.online]
    on = set(online)
    nbits = spec.possible
    sysd = "sys/devices/system/cpu"
    write(out, f"{sysd}/online", format_cpulist(online))
    write(out, f"{sysd}/possible", format_cpulist(range(spec.possible)))
    write(out, f"{sysd}/present", format_cpulist(cpus))
    write(out, f"{sysd}/offline", format_cpulist(sorted(set(range(spec.possible)) - on)))
    write(out, f"{sysd}/kernel_max", "8191")
    write(out, f"{sysd}/smt/control", spec.smt[0])
    write(out, f"{sysd}/smt/active", spec.smt[1])
    write(out, "sys/kernel/mm/transparent_hugepage/enabled", spec.thp[0])
    write(out, "sys/kernel/mm/transparent_hugepage/defrag", spec.thp[1])
    if spec.numa_balancing is not None:
        write(out, "proc/sys/kernel/numa_balancing", str(spec.numa_balancing))

    def group(pred) -> list[int]:
        return sorted(i for i in on if pred(cpus[i]))

    for c in spec.cpus:
        d = f"{sysd}/cpu{c.id}"
        if c.id != 0:                    # x86: cpu0 has no online file
            write(out, f"{d}/online", "1" if c.online else "0")
        if not c.online:
            (out / d).mkdir(parents=True, exist_ok=True)
            continue                     # topology/ and cache/ vanish when a CPU goes offline
        if spec.governor:
            write(out, f"{d}/cpufreq/scaling_governor", spec.governor)
        thread = group(lambda o: o.package == c.package and o.core_id == c.core_id)
        package = group(lambda o: o.package == c.package)
        die = group(lambda o: o.package == c.package and o.die == c.die)
        cluster = group(lambda o: o.package == c.package and o.l2 == c.l2)
        t = f"{d}/topology"
        write(out, f"{t}/physical_package_id", str(c.package))
        write(out, f"{t}/die_id", str(c.die))
        write(out, f"{t}/core_id", str(c.core_id))
        write(out, f"{t}/cluster_id", str(c.l2))
        for stem, members in (("thread_siblings", thread), ("core_cpus", thread),
                              ("core_siblings", package), ("package_cpus", package),
                              ("die_cpus", die), ("cluster_cpus", cluster)):
            write(out, f"{t}/{stem}", mask(members, nbits))
            write(out, f"{t}/{stem}_list", format_cpulist(members))
        m = spec.cpu_model
        l2_members = cluster if spec.l2_shared else thread
        l3_members = group(lambda o: o.l3 == c.l3)
        caches = [
            (1, "Data", m.l1d_kib, thread, c.l2),
            (1, "Instruction", m.l1i_kib, thread, c.l2),
            (2, "Unified", m.l2_kib, l2_members, c.l2),
            (3, "Unified", m.l3_kib, l3_members, c.l3),
        ]
        for index, (level, kind, size, members, cache_id) in enumerate(caches):
            x = f"{d}/cache/index{index}"
            write(out, f"{x}/level", str(level))
            write(out, f"{x}/type", kind)
            write(out, f"{x}/size", f"{size}K")
            write(out, f"{x}/id", str(cache_id))
            write(out, f"{x}/shared_cpu_list", format_cpulist(members))
            write(out, f"{x}/shared_cpu_map", mask(members, nbits))

    if spec.nodes is not None:
        nd = "sys/devices/system/node"
        ids = sorted(spec.nodes)
        with_cpus = sorted({cpus[i].node for i in on if cpus[i].node is not None})
        with_memory = [n for n in ids if spec.nodes[n] > 0]
        write(out, f"{nd}/online", format_cpulist(ids))
        write(out, f"{nd}/possible", spec.node_possible)
        write(out, f"{nd}/has_cpu", format_cpulist(with_cpus))
        write(out, f"{nd}/has_memory", format_cpulist(with_memory))
        normal = spec.normal_memory if spec.normal_memory is not None else with_memory
        write(out, f"{nd}/has_normal_memory", format_cpulist(normal))
        for row, n in enumerate(ids):
            members = group(lambda o: o.node == n)
            write(out, f"{nd}/node{n}/cpulist", format_cpulist(members))
            write(out, f"{nd}/node{n}/cpumap", mask(members, nbits))
            distances = spec.distances[row] if spec.distances else [10]
            write(out, f"{nd}/node{n}/distance", " ".join(str(x) for x in distances))
            write(out, f"{nd}/node{n}/meminfo", node_meminfo(n, spec.nodes[n]))
    if spec.hybrid:
        write(out, "sys/devices/cpu_core/cpus", spec.hybrid[0])
        write(out, "sys/devices/cpu_atom/cpus", spec.hybrid[1])
    write(out, "proc/cpuinfo", cpuinfo(spec, online))
    write(out, "proc/self/status", status(spec))
    write(out, "proc/self/cgroup", spec.cgroup)
    for relative, text in spec.cgroup_files.items():
        write(out, relative, text)
    if spec.meminfo_kib is not None:
        write(out, "proc/meminfo", system_meminfo(spec.meminfo_kib))


def node_meminfo(node: int, total: int) -> str:
    free = total * 9 // 10
    rows = [("MemTotal", total), ("MemFree", free), ("MemUsed", total - free), ("SwapCached", 0),
            ("Active", total // 40), ("Inactive", total // 50), ("Active(anon)", total // 100),
            ("Inactive(anon)", 0), ("Active(file)", total // 60), ("Inactive(file)", total // 50),
            ("Unevictable", 0), ("Mlocked", 0), ("Dirty", 8), ("Writeback", 0),
            ("FilePages", total // 30), ("Mapped", total // 400), ("AnonPages", total // 100),
            ("Shmem", 1024), ("KernelStack", 9216), ("PageTables", 3072), ("SecPageTables", 0),
            ("NFS_Unstable", 0), ("Bounce", 0), ("WritebackTmp", 0), ("KReclaimable", total // 300),
            ("Slab", total // 200), ("SReclaimable", total // 300), ("SUnreclaim", total // 600),
            ("AnonHugePages", 0), ("ShmemHugePages", 0), ("ShmemPmdMapped", 0), ("FileHugePages", 0),
            ("FilePmdMapped", 0), ("Unaccepted", 0)]
    lines = [f"Node {node} {key + ':':<16}{value:>9} kB" for key, value in rows]
    lines += [f"Node {node} HugePages_Total:     0", f"Node {node} HugePages_Free:      0",
              f"Node {node} HugePages_Surp:      0"]
    return "\n".join(lines)


def system_meminfo(total: int) -> str:
    free = total * 9 // 10
    rows = [("MemTotal", total), ("MemFree", free), ("MemAvailable", free + total // 30),
            ("Buffers", 20480), ("Cached", total // 30), ("SwapCached", 0), ("Active", total // 40),
            ("Inactive", total // 50), ("SwapTotal", 0), ("SwapFree", 0)]
    return "\n".join(f"{key + ':':<16}{value:>8} kB" for key, value in rows)


def cpuinfo(spec: MachineSpec, online: list[int]) -> str:
    m = spec.cpu_model
    blocks = []
    per_package: dict[int, list[CpuSpec]] = {}
    for c in spec.cpus:
        if c.online:
            per_package.setdefault(c.package, []).append(c)
    for cpu_id in online:
        c = next(x for x in spec.cpus if x.id == cpu_id)
        mates = per_package[c.package]
        lines = [
            ("processor", str(c.id)), ("vendor_id", m.vendor), ("cpu family", str(m.family)),
            ("model", str(m.model)), ("model name", m.name), ("stepping", str(m.stepping)),
            ("microcode", "0x2b000603" if m.vendor == "GenuineIntel" else "0xa0011d5"),
            ("cpu MHz", m.mhz), ("cache size", f"{m.l3_kib if m.vendor == 'GenuineIntel' else m.l2_kib} KB"),
            ("physical id", str(c.package)), ("siblings", str(len(mates))),
            ("core id", str(c.core_id)), ("cpu cores", str(len({x.core_id for x in mates}))),
            ("apicid", str(c.id * 2)), ("initial apicid", str(c.id * 2)), ("fpu", "yes"),
            ("fpu_exception", "yes"), ("cpuid level", "32" if m.vendor == "GenuineIntel" else "16"),
            ("wp", "yes"), ("flags", m.flags),
        ]
        if m.vmx:
            lines.append(("vmx flags", m.vmx))
        lines += [("bugs", m.bugs), ("bogomips", "4000.00")]
        if m.vendor == "AuthenticAMD":
            lines.append(("TLB size", "2560 4K pages"))
        lines += [("clflush size", "64"), ("cache_alignment", "64"),
                  ("address sizes", m.address_sizes)]
        text = "\n".join(f"{k}\t: {v}" if len(k) >= 8 else f"{k}\t\t: {v}" for k, v in lines)
        blocks.append(text + "\npower management:")
    return "\n\n".join(blocks) + "\n"


def status(spec: MachineSpec) -> str:
    allowed = spec.cpus_allowed or format_cpulist(range(spec.possible))
    mems = spec.mems_allowed or (format_cpulist(n for n, kib in spec.nodes.items() if kib)
                                 if spec.nodes else "0")
    return "\n".join([
        "Name:\tpython3", "Umask:\t0022", "State:\tR (running)", "Tgid:\t4242", "Ngid:\t0",
        "Pid:\t4242", "PPid:\t4200", "TracerPid:\t0", "Uid:\t1000\t1000\t1000\t1000",
        "Gid:\t1000\t1000\t1000\t1000", "FDSize:\t64", "Groups:\t1000", "NStgid:\t4242",
        "NSpid:\t4242", "NSpgid:\t4242", "NSsid:\t4200", "Kthread:\t0", "VmPeak:\t   23444 kB",
        "VmSize:\t   23444 kB", "VmLck:\t       0 kB", "VmPin:\t       0 kB", "VmHWM:\t    9216 kB",
        "VmRSS:\t    9216 kB", "RssAnon:\t    3072 kB", "RssFile:\t    6144 kB",
        "RssShmem:\t       0 kB", "VmData:\t    3584 kB", "VmStk:\t     132 kB",
        "VmExe:\t    2868 kB", "VmLib:\t    6012 kB", "VmPTE:\t      68 kB", "VmSwap:\t       0 kB",
        "HugetlbPages:\t       0 kB", "CoreDumping:\t0", "THP_enabled:\t1", "untag_mask:\t0xffffffffffffffff",
        "Threads:\t1", "SigQ:\t0/1030211", "SigPnd:\t0000000000000000", "ShdPnd:\t0000000000000000",
        "SigBlk:\t0000000000000000", "SigIgn:\t0000000001001000", "SigCgt:\t0000000100000002",
        "CapInh:\t0000000000000000", "CapPrm:\t0000000000000000", "CapEff:\t0000000000000000",
        "CapBnd:\t000001ffffffffff", "CapAmb:\t0000000000000000", "NoNewPrivs:\t0", "Seccomp:\t0",
        "Seccomp_filters:\t0", "Speculation_Store_Bypass:\tthread vulnerable",
        "SpeculationIndirectBranch:\tconditional enabled",
        f"Cpus_allowed:\t{mask(parse_cpulist(allowed), spec.possible)}",
        f"Cpus_allowed_list:\t{allowed}",
        f"Mems_allowed:\t{mask(parse_cpulist(mems), 1024)}",
        f"Mems_allowed_list:\t{mems}",
        "voluntary_ctxt_switches:\t3", "nonvoluntary_ctxt_switches:\t1",
    ])


# ---------------------------------------------------------------------------- the machines
def xeon_2s_amx() -> MachineSpec:
    """2 x Xeon Platinum 8480+ (56 cores, SMT siblings at +112), one node per socket."""
    cpus = []
    for smt in range(2):
        for package in range(2):
            for i in range(56):
                core_id = (i // 14) * 16 + i % 14          # 4 tiles of 14 enabled cores
                cpus.append(CpuSpec(smt * 112 + package * 56 + i, package, core_id, package,
                                    l3=package, l2=package * 128 + core_id * 2))
    model = CpuModel("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8480+", 8, SPR_FLAGS,
                     48, 32, 2048, 107520, vmx=VMX_FLAGS,
                     bugs="spectre_v1 spectre_v2 spec_store_bypass swapgs eibrs_pbrsb bhi")
    slice_path = "user.slice/user-1000.slice/session-3.scope"
    return MachineSpec(
        "xeon-2s-amx", model, sorted(cpus, key=lambda c: c.id), 224,
        nodes={0: 263_575_476, 1: 264_188_912}, distances=[[10, 21], [21, 10]], node_possible="0-1",
        cgroup=f"0::/{slice_path}\n",
        cgroup_files={f"sys/fs/cgroup/{slice_path}/cpu.max": "max 100000",
                      "sys/fs/cgroup/user.slice/cpu.max": "max 100000"},
        numa_balancing=1, governor="powersave",          # Ubuntu defaults, intel_pstate
    )


def epyc_4node_nps4() -> MachineSpec:
    """EPYC 7763 (64 cores, 8 CCX of 8 cores each with its own L3), NPS4, SMT at +64."""
    cpus = []
    for smt in range(2):
        for core in range(64):
            cpus.append(CpuSpec(smt * 64 + core, 0, core, core // 16, l3=core // 8, l2=core))
    model = CpuModel("AuthenticAMD", 25, 1, "AMD EPYC 7763 64-Core Processor", 1, MILAN_FLAGS,
                     32, 32, 512, 32768, mhz="2450.000",
                     bugs="sysret_ss_attrs spectre_v1 spectre_v2 spec_store_bypass srso",
                     address_sizes="48 bits physical, 48 bits virtual")
    near, far = 11, 12
    distances = [[10, near, far, far], [near, 10, far, far], [far, far, 10, near], [far, far, near, 10]]
    return MachineSpec(
        "epyc-4node-nps4", model, sorted(cpus, key=lambda c: c.id), 128,
        nodes={n: 131_811_200 for n in range(4)}, distances=distances, node_possible="0-3",
        cgroup="0::/system.slice/batch.service\n",
        cgroup_files={"sys/fs/cgroup/system.slice/batch.service/cpu.max": "max 100000"},
        thp=THP_ALWAYS, numa_balancing=1, governor="performance",   # RHEL, tuned throughput profile
    )


def hybrid_laptop() -> MachineSpec:
    """Core i7-1260P: 4 P cores with SMT (CPUs 0-7, adjacent siblings) + 8 E cores (8-15)."""
    cpus = []
    for p in range(4):
        for t in range(2):
            cpus.append(CpuSpec(p * 2 + t, 0, p * 4, 0, l3=0, l2=p * 8))
    for e in range(8):
        cpus.append(CpuSpec(8 + e, 0, 16 + e, 0, l3=0, l2=32 + (e // 4) * 8))
    model = CpuModel("GenuineIntel", 6, 154, "12th Gen Intel(R) Core(TM) i7-1260P", 3, ADL_FLAGS,
                     48, 32, 1280, 18432, vmx=VMX_FLAGS,
                     bugs="spectre_v1 spectre_v2 spec_store_bypass swapgs eibrs_pbrsb rfds bhi",
                     address_sizes="39 bits physical, 48 bits virtual")
    scope = "user.slice/user-1000.slice/user@1000.service/app.slice/app-org.gnome.Terminal.slice/vte-spawn-1.scope"
    return MachineSpec(
        "hybrid-laptop", model, cpus, 16, nodes={0: 16_111_404}, hybrid=("0-7", "8-15"),
        l2_shared=True, cgroup=f"0::/{scope}\n",
        cgroup_files={f"sys/fs/cgroup/{scope}/cpu.max": "max 100000"},
        governor="powersave",                            # one node: NUMA balancing stays 0
    )


def vm_adjacent_smt() -> MachineSpec:
    """8-vCPU cloud VM (Cascade Lake) exposing SMT pairs as adjacent ids 0-1, 2-3, ...; cgroup v1."""
    cpus = [CpuSpec(i, 0, i // 2, 0, l3=0, l2=i // 2) for i in range(8)]
    model = CpuModel("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Platinum 8272CL CPU @ 2.60GHz", 7,
                     CLX_VM_FLAGS, 32, 32, 1024, 36608, mhz="2593.906",
                     bugs="spectre_v1 spectre_v2 spec_store_bypass swapgs taa itlb_multihit mmio_stale_data retbleed gds",
                     address_sizes="46 bits physical, 48 bits virtual")
    docker = "docker/3f1c2ab9d0e4"
    return MachineSpec(
        "vm-adjacent-smt", model, cpus, 8, nodes={0: 32_871_140},
        cgroup=(f"12:cpuset:/{docker}\n11:memory:/{docker}\n4:cpu,cpuacct:/{docker}\n"
                f"1:name=systemd:/{docker}\n0::/{docker}\n"),
        cgroup_files={f"sys/fs/cgroup/cpu,cpuacct/{docker}/cpu.cfs_quota_us": "600000",
                      f"sys/fs/cgroup/cpu,cpuacct/{docker}/cpu.cfs_period_us": "100000",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"},
    )


def container_cpuset() -> MachineSpec:
    """A container on a Xeon Gold 6338 host (32 cores, SMT +32): cpuset 4-7,36-39, cpu.max 2.5."""
    cpus = []
    for smt in range(2):
        for core in range(32):
            cpus.append(CpuSpec(smt * 32 + core, 0, core, 0, l3=0, l2=core))
    model = CpuModel("GenuineIntel", 6, 106, "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", 6, ICX_FLAGS,
                     48, 32, 1280, 49152, vmx=VMX_FLAGS)
    return MachineSpec(
        "container-cpuset", model, sorted(cpus, key=lambda c: c.id), 64, nodes={0: 527_988_412},
        cpus_allowed="4-7,36-39", mems_allowed="0", cgroup="0::/\n",
        cgroup_files={"sys/fs/cgroup/cpu.max": "250000 100000"},
        thp=THP_ALWAYS, governor="performance",          # the bare-metal host's sysfs
    )


def offline_cpus() -> MachineSpec:
    """Xeon E-2288G (8 cores, SMT +8) with CPUs 3, 5 and 13 taken offline."""
    offline = {3, 5, 13}
    cpus = [CpuSpec(i, 0, i % 8, 0, l3=0, l2=i % 8, online=i not in offline) for i in range(16)]
    for c in cpus:
        if not c.online:
            c.node = None
    model = CpuModel("GenuineIntel", 6, 158, "Intel(R) Xeon(R) E-2288G CPU @ 3.70GHz", 13, CFL_FLAGS,
                     32, 32, 256, 16384, vmx=VMX_FLAGS, address_sizes="39 bits physical, 48 bits virtual")
    return MachineSpec(
        "offline-cpus", model, cpus, 16, nodes={0: 65_702_012}, cpus_allowed="0-15",
        cgroup="0::/system.slice/inference.service\n",
        cgroup_files={"sys/fs/cgroup/system.slice/inference.service/cpu.max": "max 100000"},
        governor="powersave",                            # offline CPUs have no readable policy
    )


def memory_only_node() -> MachineSpec:
    """Xeon Gold 6426Y (16 cores, SMT +16) on node 0, plus CXL memory as CPU-less node 2."""
    cpus = []
    for smt in range(2):
        for core in range(16):
            cpus.append(CpuSpec(smt * 16 + core, 0, core, 0, l3=0, l2=core))
    model = CpuModel("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Gold 6426Y", 8, SPR_FLAGS,
                     48, 32, 2048, 38400, vmx=VMX_FLAGS)
    return MachineSpec(
        "memory-only-node", model, sorted(cpus, key=lambda c: c.id), 32,
        nodes={0: 131_453_812, 2: 134_217_728}, distances=[[10, 50], [50, 10]], node_possible="0-3",
        normal_memory=[0], cgroup="0::/user.slice\n",
        thp=THP_ALWAYS, numa_balancing=1, governor="performance",   # the CXL node counts as a node
    )


def vm_no_node() -> MachineSpec:
    """4-vCPU Milan VM with a kernel built without NUMA: no sys/devices/system/node."""
    cpus = [CpuSpec(i, 0, i, None, l3=0, l2=i) for i in range(4)]
    model = CpuModel("AuthenticAMD", 25, 1, "AMD EPYC 7B13", 0, MILAN_VM_FLAGS, 32, 32, 512, 32768,
                     mhz="2449.998", bugs="sysret_ss_attrs null_seg spectre_v1 spectre_v2 spec_store_bypass srso",
                     address_sizes="48 bits physical, 48 bits virtual")
    return MachineSpec(
        "vm-no-node", model, cpus, 4, nodes=None, meminfo_kib=16_374_820,
        cgroup="4:cpu,cpuacct:/\n1:name=systemd:/init.scope\n0::/init.scope\n",
        cgroup_files={"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",
                      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"},
        thp=THP_ALWAYS, numa_balancing=None,             # no CONFIG_NUMA: no numa_balancing
        smt=("notsupported", "0"),                       # one thread per vCPU core
    )


def xeon_max_snc4_hbm() -> MachineSpec:
    """2 x Xeon CPU Max 9462 (32 cores, SMT +64), SNC4 with HBM in flat mode: CPU nodes 0-7,
    CPU-less HBM nodes 8-15 (ids >= 10), one L3 per socket spanning its four nodes."""
    cpus = []
    for smt in range(2):
        for package in range(2):
            for i in range(32):
                cpus.append(CpuSpec(smt * 64 + package * 32 + i, package, i, package * 4 + i // 8,
                                    l3=package, l2=package * 64 + i * 2))
    model = CpuModel("GenuineIntel", 6, 143, "Intel(R) Xeon(R) CPU Max 9462", 8, SPR_FLAGS,
                     48, 32, 2048, 76800, vmx=VMX_FLAGS)
    nodes = {n: 64_878_080 for n in range(8)}
    nodes.update({n: 16_515_072 for n in range(8, 16)})

    def distance(a: int, b: int) -> int:
        same_socket = (a % 8) // 4 == (b % 8) // 4
        if a == b:
            return 10
        hbm = (a >= 8) or (b >= 8)
        if (a % 8) == (b % 8):
            return 13                       # a quadrant's own DDR <-> HBM
        if same_socket:
            return 14 if hbm else 12
        return 23 if hbm else 21

    return MachineSpec(
        "xeon-max-snc4-hbm", model, sorted(cpus, key=lambda c: c.id), 128, nodes=nodes,
        distances=[[distance(a, b) for b in range(16)] for a in range(16)], node_possible="0-15",
        cgroup="0::/\n",
        thp=THP_ALWAYS, numa_balancing=0, governor="performance",   # HPC node: balancing off
    )


MACHINES = (xeon_2s_amx, epyc_4node_nps4, hybrid_laptop, vm_adjacent_smt, container_cpuset,
            offline_cpus, memory_only_node, vm_no_node, xeon_max_snc4_hbm)


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        for make in MACHINES:
            spec = make()
            build(spec, Path(scratch) / spec.name)
            archive = HERE / f"{spec.name}.tar.xz"
            count = write_archive(str(Path(scratch) / spec.name), str(archive))
            print(f"wrote {archive.name} ({count} entries, {archive.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
