"""A real machine's record: tests/machines/spr16.tar.xz, written by ``xlaunch-record-machine
--archive`` on a 16-core Intel Xeon VM with AMX (cpuinfo: family 6 model 207, Emerald Rapids
sold as "Intel(R) Xeon(R) Processor"; 1 NUMA node, no SMT, one 300 MiB L3).

Expectations come from the record's own files (read here with plain ``open``), not from the
reader's output: the model, the plans (4x4, 16x1, 1x16, ``--throughput-mode``,
``--ncore_per_instance``), ``--check-isa``, ``--show-topology`` and what ``--summary-json``
would hold after a 4x4 run there. Everything runs in-process: no torch, no subprocess.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
from machine_trees import MACHINE_NAMES, machine_tree

from xlaunch._records import replace
from xlaunch.cpulist import parse_cpulist
from xlaunch.launcher.api import run_command_line
from xlaunch.launcher.observe.observer import Observed, cells, compare, to_json
from xlaunch.launcher.observe.summary import InstanceResult, summary_json, table_lines
from xlaunch.launcher.plan.options import Options
from xlaunch.launcher.plan.planner import plan
from xlaunch.machine import ISA_FLAGS, Library, load_machine

NAME = "spr16"
CPU = "sys/devices/system/cpu"
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
IOMP = "/opt/venv/lib/libiomp5.so"


@functools.lru_cache(maxsize=None)
def tree() -> Path:
    return machine_tree(NAME)


@functools.lru_cache(maxsize=None)
def machine():
    return load_machine(str(tree()))


def text(relative: str) -> str:
    return (tree() / relative).read_text().strip()


def cpulist(relative: str) -> tuple[int, ...]:
    return parse_cpulist(text(relative))


def cpuinfo_blocks() -> list[dict[str, str]]:
    blocks = []
    for block in text("proc/cpuinfo").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        blocks.append(fields)
    return blocks


def with_libraries(m):
    """The recorded machine with jemalloc and Intel OpenMP found (libraries are not recorded:
    a plan there must not depend on what the test host has installed)."""
    return replace(m, libraries=(Library("iomp", IOMP, "venv"), Library("jemalloc", JEMALLOC, "ldconfig")))


def plan_of(**values):
    return plan(Options(program="infer.py", python="/py", **values), with_libraries(machine()), {"PATH": "/usr/bin"})


def cli(monkeypatch, capsys, *argv: str) -> str:
    """``xlaunch ARGV`` in this process on the record; its stdout (stderr: ``cli.err``)."""
    monkeypatch.setenv("XLAUNCH_FSROOT", str(tree()))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    status = run_command_line(list(argv))
    captured = capsys.readouterr()
    assert status == 0, captured
    cli.err = captured.err
    return captured.out


# ------------------------------------------------------------------ the record is the kernel's

def test_spr16_is_a_recorded_machine() -> None:
    assert NAME in MACHINE_NAMES


def test_the_record_holds_what_the_kernel_exposes() -> None:
    """Faithful to sysfs/procfs of a 16-CPU guest: every list agrees with every other."""
    online = cpulist(f"{CPU}/online")
    assert online == cpulist(f"{CPU}/possible") == cpulist(f"{CPU}/present") == tuple(range(16))
    assert text(f"{CPU}/offline") == ""
    assert not (tree() / f"{CPU}/cpu0/online").exists()        # x86's boot CPU cannot go offline
    for cpu in online:
        base = f"{CPU}/cpu{cpu}"
        if cpu:
            assert text(f"{base}/online") == "1"
        assert text(f"{base}/topology/thread_siblings_list") == str(cpu)      # no SMT
        assert text(f"{base}/topology/core_id") == str(cpu)
        assert text(f"{base}/topology/physical_package_id") == "0"
        assert cpulist(f"{base}/topology/package_cpus_list") == online
        levels = [text(f"{base}/cache/index{i}/level") for i in range(4)]
        assert levels == ["1", "1", "2", "3"]
        assert cpulist(f"{base}/cache/index3/shared_cpu_list") == online
        assert text(f"{base}/cache/index3/size") == "307200K"
    assert (text(f"{CPU}/smt/control"), text(f"{CPU}/smt/active")) == ("notsupported", "0")
    assert [p.name for p in (tree() / "sys/devices/system/node").glob("node*")] == ["node0"]
    assert cpulist("sys/devices/system/node/node0/cpulist") == online
    assert text("sys/devices/system/node/node0/distance") == "10"
    blocks = cpuinfo_blocks()
    assert [int(b["processor"]) for b in blocks] == list(online)
    assert len({b["flags"] for b in blocks}) == 1                   # one flag line for every CPU
    assert (blocks[0]["cpu family"], blocks[0]["model"]) == ("6", "207")
    assert "hypervisor" in blocks[0]["flags"].split()
    status = dict(line.split(":\t", 1) for line in text("proc/self/status").splitlines() if ":\t" in line)
    assert status["Cpus_allowed_list"] == "0-15" and status["Mems_allowed_list"] == "0"
    cgroup = text("proc/self/cgroup")
    assert cgroup.startswith("0::/")                                # cgroup v2 only
    parent, leaf = cgroup[4:].split("/")
    # the cpu controller is on for the parent only (no cpu.max in the leaf), and sets no quota
    assert text(f"sys/fs/cgroup/{parent}/cpu.max") == "max 100000"
    assert not (tree() / f"sys/fs/cgroup/{parent}/{leaf}/cpu.max").exists()


# ------------------------------------------------------------------ the model

def test_the_model_reads_the_record() -> None:
    m = machine()
    assert m.online_cpus == tuple(range(16)) and len(m.cpus) == 16
    assert [core.cpus for core in m.cores] == [(c,) for c in range(16)]
    assert {(c.package, c.node, c.l3) for c in m.cores} == {(0, 0, 0)}
    assert [(n.id, n.cpus, n.distances) for n in m.nodes] == [(0, tuple(range(16)), ((0, 10),))]
    memory = int(text("sys/devices/system/node/node0/meminfo").split("MemTotal:")[1].split()[0])
    assert m.node(0).memory_kib == memory == 4_550_128
    # the node counts 4.3 GiB where proc/meminfo counts 125.9: the model says so
    assert any("lower bounds" in note and "125.9 GiB" in note for note in m.notes), m.notes
    assert [(d.cpus, d.size_kib) for d in m.l3_domains] == [(tuple(range(16)), 307_200)]
    assert m.allowed_cpus == tuple(range(16)) and m.allowed_mems == (0,) and m.cpu_budget is None
    assert m.isa.vendor == "GenuineIntel" and m.isa.model_name == "Intel(R) Xeon(R) Processor"
    flags = set(cpuinfo_blocks()[0]["flags"].split())
    assert m.isa.flags == flags
    assert {f for f in ISA_FLAGS if m.isa.has(f)} == set(ISA_FLAGS) - {"amx_fp16"}   # Granite Rapids adds AMX-FP16
    assert m.isa.amx_permitted is None
    host = m.host
    assert (host.thp_enabled, host.thp_defrag, host.numa_balancing) == ("madvise", "madvise", "0")
    assert (host.smt_control, host.smt_active) == ("notsupported", False)
    assert host.governors == ()    # recorded before cpu/cpufreq/ was kept: unknown, not "none"


# ------------------------------------------------------------------ plans

@pytest.mark.parametrize("values, slices", [
    ({"ninstances": 4, "ncores_per_instance": 4}, [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]),
    ({"ninstances": 16, "ncores_per_instance": 1}, [[c] for c in range(16)]),
    ({"ninstances": 1, "ncores_per_instance": 16}, [range(16)]),
    ({"throughput_mode": True}, [range(16)]),                      # one instance per node
    ({"ncores_per_instance": 4}, [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]),
    ({"ncores_per_instance": 5}, [range(0, 5), range(5, 10), range(10, 15)]),   # CPU 15 idles
    ({"ninstances": 3}, [range(0, 5), range(5, 10), range(10, 15)]),
    ({"latency_mode": True}, [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]),
], ids=["4x4", "16x1", "1x16", "throughput", "ncores-4", "ncores-5", "ninstances-3", "latency"])
def test_plans(values, slices) -> None:
    p = plan_of(**values)
    expected = [tuple(s) for s in slices]
    assert [i.cpus for i in p.instances] == expected
    used = {c for s in expected for c in s}
    assert p.idle_cpus == tuple(c for c in range(16) if c not in used)
    assert (p.allocator, p.openmp) == ("jemalloc", "intel")
    for instance in p.instances:
        width = len(instance.cpus)
        assert instance.mem_nodes == (0,) and instance.membind == "bind" and instance.bind == "native"
        assert instance.env["OMP_NUM_THREADS"] == str(width) == instance.env["MKL_NUM_THREADS"]
        cpus = ",".join(map(str, instance.cpus))
        rest = ",".join(map(str, instance.cpus[1:]))
        assert instance.env["KMP_AFFINITY"] == f"granularity=fine,proclist=[{{{cpus}}}{',' + rest if rest else ''}],explicit"
        assert instance.env["LD_PRELOAD"] == f"{JEMALLOC}:{IOMP}"
        assert instance.argv == ("/py", "-u", "infer.py")
    if p.idle_cpus:
        assert any(f"{len(p.idle_cpus)} of 16 cores stay idle" in w for w in p.warnings), p.warnings


def test_the_ipexrun_spelling_through_the_cli(monkeypatch, capsys) -> None:
    data = json.loads(cli(monkeypatch, capsys, "--dry-run", "--json", "--ninstances", "4",
                          "--ncore_per_instance", "4", "--no-python", "true"))
    assert [i["cpus"] for i in data["instances"]] == [list(range(k, k + 4)) for k in (0, 4, 8, 12)]
    assert data["idle_cpus"] == [] and {i["env"]["OMP_NUM_THREADS"] for i in data["instances"]} == {"4"}
    assert "--ncore_per_instance (ipexrun 1.x) means --ncores-per-instance" in cli.err


# ------------------------------------------------------------------ --check-isa and --show-topology

def test_check_isa(monkeypatch, capsys) -> None:
    data = json.loads(cli(monkeypatch, capsys, "--check-isa", "--json"))
    flags = set(cpuinfo_blocks()[0]["flags"].split())
    assert data["isa"] == {flag: flag in flags for flag in ISA_FLAGS}
    assert data["isa"]["amx_bf16"] and data["isa"]["amx_int8"] and data["isa"]["avx512_fp16"]
    assert not data["isa"]["amx_fp16"]
    assert data["amx_permitted"] is None          # a record is not asked for the AMX grant
    assert {dtype: advice["fast"] for dtype, advice in data["advice"].items()} == \
        {"fp32": True, "bf16": True, "fp16": True, "int8": True}
    out = cli(monkeypatch, capsys, "--check-isa")
    assert "CPU: Intel(R) Xeon(R) Processor (GenuineIntel)" in out
    assert re.search(r"bf16\s+yes\s+AMX-BF16 tiles", out) and re.search(r"int8\s+yes\s+AMX-INT8 tiles", out)
    assert re.search(r"fp16\s+yes\s+AVX512_FP16 arithmetic", out)
    assert "AMX granted to this process: not checked" in out


def test_show_topology(monkeypatch, capsys) -> None:
    out = cli(monkeypatch, capsys, "--show-topology")
    assert "CPUs: 16 present, 16 online (0-15)" in out
    assert "Packages: 1   Physical cores: 16" in out
    assert "node   0: cpus 0-15; 4.3 GiB; distances 0:10" in out
    assert "L3 0: cpus 0-15 (300 MiB)" in out
    assert "Allowed CPUs: 0-15 (16)" in out and "CPU budget: unlimited" in out
    assert re.search(r"SMT:\s+notsupported, inactive", out)
    assert re.search(r"automatic NUMA balancing:\s+disabled", out)
    assert "node memory sizes are lower bounds" in out
    rows = re.findall(r"^\s+(\d+): (\d+)\s+\[node 0, L3 0, package 0, unknown\]$", out, re.M)
    assert rows == [(str(c), str(c)) for c in range(16)]
    data = json.loads(cli(monkeypatch, capsys, "--show-topology", "--json"))
    assert [c["siblings"] for c in data["cpus"]] == [[c] for c in range(16)]
    assert data["nodes"][0]["memory_kib"] == 4_550_128


# ------------------------------------------------------------------ what --summary-json would say

def observed_as_planned(instance, threads: int, stray_cpu=None) -> Observed:
    """What the observer reads of a 4x4 instance running examples/infer.py there: its OpenMP
    team on its own CPUs, jemalloc and libiomp5 mapped, its memory on node 0."""
    tids = [(1000 + k, (instance.cpus[k % len(instance.cpus)],)) for k in range(threads)]
    if stray_cpu is not None:
        tids[-1] = (tids[-1][0], (stray_cpu,))
    return Observed(samples=5, processes=1, threads=threads,
                    thread_cpus=tuple(sorted({c for _, cs in tids for c in cs})), cpus_by_thread=tuple(tids),
                    libraries=(("jemalloc", JEMALLOC), ("iomp", IOMP)), openmp_active=(IOMP,),
                    memory_by_node=((0, 300 << 20),), mem_nodes=instance.mem_nodes)


def test_summary_json_of_a_4x4_run() -> None:
    p = plan_of(ninstances=4, ncores_per_instance=4)
    rows = []
    for instance in p.instances:
        seen = observed_as_planned(instance, threads=4)
        assert compare(seen, instance.cpus, instance.mem_nodes, p.allocator, p.openmp) == []
        rows.append(InstanceResult(index=instance.index, cpus=instance.cpus, mem_nodes=instance.mem_nodes,
                                   status=0, text="exit 0", wall_s=12.5, observed=to_json(seen), cells=cells(seen)))
    data = summary_json(rows, 0, allocator=p.allocator, openmp=p.openmp)
    assert (data["exit_status"], data["allocator"], data["openmp"]) == (0, "jemalloc", "intel")
    for k, entry in enumerate(data["instances"]):
        assert entry["index"] == k and entry["cpus"] == list(range(4 * k, 4 * k + 4)) and entry["mem_nodes"] == [0]
        assert (entry["status"], entry["exit_code"]) == ("exit 0", 0)
        seen = entry["observed"]
        assert (seen["allocator"], seen["openmp"], seen["threads"]) == ("jemalloc", ["intel"], 4)
        assert seen["thread_cpus"] == entry["cpus"] and seen["remote_memory_pct"] == 0.0
    lines = table_lines(rows, 0)
    assert re.match(r"instance\s+cpus\s+status\s+wall\s+threads\s+ran on\s+allocator\s+openmp\s+remote mem", lines[0])
    assert re.match(r"0\s+0-3\s+exit 0\s+12.50s\s+4\s+0-3\s+jemalloc\s+intel\s+0%", lines[1])
    json.dumps(data)    # JSON-ready as is


def test_a_thread_outside_its_slice_is_reported() -> None:
    p = plan_of(ninstances=4, ncores_per_instance=4)
    first = p.instances[0]
    seen = observed_as_planned(first, threads=4, stray_cpu=5)
    assert compare(seen, first.cpus, first.mem_nodes, p.allocator, p.openmp) == [
        "1 of 4 threads ran outside the planned CPUs 0-3 (seen on 5)"]
