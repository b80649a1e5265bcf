"""The exact machine model of every recorded tree under tests/machines/.

Expectations are written from the machine's description (vendor documentation of the part,
the kernel's numbering), not from the reader's output.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from machine_trees import MACHINE_NAMES, machine_tree

from xlaunch.machine import EFFICIENCY, ISA_FLAGS, PERFORMANCE, UNKNOWN_KIND, load_machine

TREES = MACHINE_NAMES

SPR = {"amx_bf16", "amx_int8", "amx_tile", "avx512f", "avx512bw", "avx512vl", "avx512dq",
       "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "avx2", "fma"}
AVX512_VNNI_ONLY = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma"}
AVX2_ONLY = {"avx2", "fma"}


@functools.lru_cache(maxsize=None)
def load(name: str):
    return load_machine(str(machine_tree(name)))


def core_cpus(machine) -> list[tuple[int, ...]]:
    return [core.cpus for core in machine.cores]


def isa_set(machine) -> set[str]:
    return {flag for flag in ISA_FLAGS if machine.isa.has(flag)}


def assert_consistent(machine) -> None:
    """Invariants every model must satisfy."""
    online = set(machine.online_cpus)
    in_cores = [cpu for core in machine.cores for cpu in core.cpus]
    assert sorted(in_cores) == sorted(online), "each online CPU is in exactly one core"
    assert [core.index for core in machine.cores] == list(range(len(machine.cores)))
    for cpu in machine.cpus:
        if cpu.online:
            assert cpu.id in cpu.siblings
            assert machine.core_of(cpu.id).cpus == cpu.siblings
        if cpu.l3 is not None:
            assert cpu.id in machine.l3_domains[cpu.l3].cpus
        if cpu.node is not None:
            assert cpu.id in machine.node(cpu.node).cpus
    assert set(machine.allowed_cpus) <= online
    # Cores are ordered by node, then L3 domain, then package, then core id.
    keys = [(c.node, c.l3, c.package, machine.cpu(c.cpus[0]).core_id) for c in machine.cores]
    assert keys == sorted(keys)


def test_all_expected_trees_are_recorded():
    assert {"xeon-2s-amx", "epyc-4node-nps4", "hybrid-laptop", "vm-adjacent-smt", "container-cpuset",
            "offline-cpus", "memory-only-node", "vm-no-node", "xeon-max-snc4-hbm", "spr16"} <= set(TREES)


@pytest.mark.parametrize("name", TREES)
def test_invariants_hold(name):
    assert_consistent(load(name))


def test_xeon_2s_amx():
    m = load("xeon-2s-amx")
    assert len(m.cpus) == 224 and m.online_cpus == tuple(range(224))
    socket0 = list(range(0, 56)) + list(range(112, 168))
    socket1 = list(range(56, 112)) + list(range(168, 224))
    assert core_cpus(m) == [(i, i + 112) for i in range(112)]
    assert [c.package for c in m.cores] == [0] * 56 + [1] * 56
    assert [(n.id, list(n.cpus)) for n in m.nodes] == [(0, socket0), (1, socket1)]
    assert m.node(0).distances == ((0, 10), (1, 21)) and m.node(1).distances == ((0, 21), (1, 10))
    assert m.node(0).memory_kib == 263_575_476
    assert [list(d.cpus) for d in m.l3_domains] == [socket0, socket1]
    assert {d.size_kib for d in m.l3_domains} == {107_520}
    cpu70 = m.cpu(70)   # package 1, 15th core: tile 1, slot 0 -> core_id 16
    assert (cpu70.package, cpu70.die, cpu70.core_id, cpu70.siblings, cpu70.node, cpu70.l3) == (1, 0, 16, (70, 182), 1, 1)
    assert {c.kind for c in m.cores} == {UNKNOWN_KIND} and not m.is_hybrid
    assert m.allowed_cpus == tuple(range(224)) and m.allowed_mems == (0, 1)
    assert m.cpu_budget is None
    assert isa_set(m) == SPR   # Sapphire Rapids: AMX BF16/INT8 but no AMX-FP16
    assert m.isa.vendor == "GenuineIntel" and m.isa.model_name == "Intel(R) Xeon(R) Platinum 8480+"
    assert m.isa.amx_permitted is None     # a recorded tree is not asked about permissions
    assert m.notes == ()


def test_epyc_4node_nps4():
    m = load("epyc-4node-nps4")
    assert len(m.cpus) == 128
    assert core_cpus(m) == [(c, c + 64) for c in range(64)]
    assert [c.node for c in m.cores] == [c // 16 for c in range(64)]
    assert [c.l3 for c in m.cores] == [c // 8 for c in range(64)]
    for n in range(4):
        expected = list(range(16 * n, 16 * n + 16)) + list(range(64 + 16 * n, 64 + 16 * n + 16))
        assert list(m.node(n).cpus) == expected
    assert [d for _, d in m.node(0).distances] == [10, 11, 12, 12]
    assert [d for _, d in m.node(3).distances] == [12, 12, 11, 10]
    assert len(m.l3_domains) == 8
    for k, domain in enumerate(m.l3_domains):
        assert list(domain.cpus) == list(range(8 * k, 8 * k + 8)) + list(range(64 + 8 * k, 72 + 8 * k))
        assert domain.size_kib == 32768
    assert m.allowed_mems == (0, 1, 2, 3) and m.cpu_budget is None
    assert isa_set(m) == AVX2_ONLY   # Zen 3: no AVX-512
    assert m.isa.vendor == "AuthenticAMD"


def test_hybrid_laptop():
    m = load("hybrid-laptop")
    assert core_cpus(m) == [(0, 1), (2, 3), (4, 5), (6, 7)] + [(c,) for c in range(8, 16)]
    assert [c.kind for c in m.cores] == [PERFORMANCE] * 4 + [EFFICIENCY] * 8
    assert m.is_hybrid
    assert m.cpu(9).kind == EFFICIENCY and m.cpu(1).kind == PERFORMANCE
    assert [m.cpu(c).core_id for c in (0, 2, 4, 6, 8, 15)] == [0, 4, 8, 12, 16, 23]
    assert [list(d.cpus) for d in m.l3_domains] == [list(range(16))]
    assert isa_set(m) == {"avx_vnni", "avx2", "fma"}   # Alder Lake: AVX-VNNI, AVX-512 fused off


def test_vm_adjacent_smt():
    m = load("vm-adjacent-smt")
    assert core_cpus(m) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert m.cpu(5).siblings == (4, 5) and m.cpu(5).core_id == 2
    assert m.cpu_budget == 6.0             # cgroup v1: 600000 / 100000 in cpu,cpuacct
    assert isa_set(m) == AVX512_VNNI_ONLY  # Cascade Lake: VNNI, no BF16


def test_container_cpuset():
    m = load("container-cpuset")
    assert len(m.online_cpus) == 64 and core_cpus(m) == [(c, c + 32) for c in range(32)]
    assert m.allowed_cpus == (4, 5, 6, 7, 36, 37, 38, 39)
    assert m.allowed_mems == (0,)
    assert m.cpu_budget == 2.5             # cgroup v2 cpu.max "250000 100000"
    assert isa_set(m) == AVX512_VNNI_ONLY


def test_offline_cpus():
    m = load("offline-cpus")
    assert len(m.cpus) == 16
    assert m.online_cpus == (0, 1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 14, 15)
    assert core_cpus(m) == [(0, 8), (1, 9), (2, 10), (11,), (4, 12), (6, 14), (7, 15)]
    for cpu in (3, 5, 13):   # the kernel removed their topology/ and cache/
        c = m.cpu(cpu)
        assert (c.online, c.package, c.core_id, c.siblings, c.node, c.l3) == (False, None, None, (cpu,), None, None)
    assert m.cpu(11).siblings == (11,) and m.cpu(11).core_id == 3
    assert m.node(0).cpus == m.online_cpus
    assert m.l3_domains[0].cpus == m.online_cpus
    # Cpus_allowed_list names offline CPUs too; like sched_getaffinity we report online ones.
    assert m.allowed_cpus == m.online_cpus
    assert isa_set(m) == AVX2_ONLY
    assert m.notes == ()


def test_memory_only_node():
    m = load("memory-only-node")
    assert [n.id for n in m.nodes] == [0, 2]
    assert m.node(0).cpus == tuple(range(32)) and m.node(2).cpus == ()
    assert m.node(2).memory_kib == 134_217_728
    assert m.node(0).distances == ((0, 10), (2, 50)) and m.node(2).distances == ((0, 50), (2, 10))
    assert {c.node for c in m.cores} == {0}
    assert m.allowed_mems == (0, 2)
    assert core_cpus(m) == [(c, c + 16) for c in range(16)]
    assert "amx_tile" in isa_set(m)


def test_vm_no_node():
    m = load("vm-no-node")
    assert [(n.id, n.cpus) for n in m.nodes] == [(0, (0, 1, 2, 3))]
    assert m.node(0).memory_kib == 16_374_820          # from proc/meminfo
    assert core_cpus(m) == [(0,), (1,), (2,), (3,)]
    assert all(c.node == 0 for c in m.cores)
    assert m.cpu_budget is None                       # v1 quota -1
    assert any("node" in note for note in m.notes)
    assert isa_set(m) == AVX2_ONLY


def test_xeon_max_sparse_nodes_ids_above_ten():
    m = load("xeon-max-snc4-hbm")
    assert [n.id for n in m.nodes] == list(range(16))
    for n in range(8):
        package, quadrant = divmod(n, 4)
        first = package * 32 + quadrant * 8
        assert list(m.node(n).cpus) == list(range(first, first + 8)) + list(range(first + 64, first + 72))
    for n in range(8, 16):          # HBM in flat mode: memory-only nodes, ids up to 15
        assert m.node(n).cpus == () and m.node(n).memory_kib == 16_515_072
    assert dict(m.node(11).distances)[11] == 10 and dict(m.node(11).distances)[3] == 13
    assert dict(m.node(9).distances)[12] == 23
    assert core_cpus(m) == [(c, c + 64) for c in range(64)]
    assert [c.node for c in m.cores] == [c // 8 for c in range(64)]
    # One L3 per socket spans four SNC nodes.
    assert [len(d.cpus) for d in m.l3_domains] == [64, 64]
    assert [c.l3 for c in m.cores] == [0] * 32 + [1] * 32
    assert m.allowed_mems == tuple(range(16))
    assert m.isa.model_name == "Intel(R) Xeon(R) CPU Max 9462"


# Host settings a tuning check reads: (THP mode, numa_balancing, SMT control, SMT active, governor).
# None: the kernel has no such file there (no CONFIG_NUMA; no cpufreq inside a VM).
HOST = {
    "xeon-2s-amx": ("madvise", "1", "on", "1", "powersave"),          # Ubuntu, intel_pstate default
    "epyc-4node-nps4": ("always", "1", "on", "1", "performance"),      # RHEL, tuned
    "hybrid-laptop": ("madvise", "0", "on", "1", "powersave"),
    "vm-adjacent-smt": ("madvise", "0", "on", "1", None),
    "container-cpuset": ("always", "0", "on", "1", "performance"),    # the bare-metal host's sysfs
    "offline-cpus": ("madvise", "0", "on", "1", "powersave"),
    "memory-only-node": ("always", "1", "on", "1", "performance"),    # the CXL node is a second node
    "vm-no-node": ("always", None, "notsupported", "0", None),
    "xeon-max-snc4-hbm": ("always", "0", "on", "1", "performance"),   # HPC: balancing off
    "spr16": ("madvise", "0", "notsupported", "0", None),             # recorded: a 16-core VM (test_spr16.py)
}


def read(root: Path, relative: str):
    path = root / relative
    return path.read_text().strip() if path.exists() else None


def selected(text: str) -> str:
    """The bracketed choice of a sysfs selector such as ``always [madvise] never``."""
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    assert len(chosen) == 1, text
    return chosen[0]


@pytest.mark.parametrize("name", TREES)
def test_host_settings_are_the_kernels_files(name):
    root, m = machine_tree(name), load(name)
    thp, balancing, control, active, governor = HOST[name]
    enabled = read(root, "sys/kernel/mm/transparent_hugepage/enabled")
    assert enabled.replace("[", "").replace("]", "") == "always madvise never" and selected(enabled) == thp
    defrag = read(root, "sys/kernel/mm/transparent_hugepage/defrag")
    assert defrag.replace("[", "").replace("]", "") == "always defer defer+madvise madvise never"
    assert selected(defrag) == "madvise"
    assert read(root, "proc/sys/kernel/numa_balancing") == balancing
    if balancing == "1":
        assert len(m.nodes) > 1                         # the kernel enables it only with several nodes
    assert (balancing is None) == (not (root / "sys/devices/system/node").is_dir())
    assert (read(root, "sys/devices/system/cpu/smt/control"), read(root, "sys/devices/system/cpu/smt/active")) \
        == (control, active)
    assert (active == "1") == any(len(core.cpus) > 1 for core in m.cores)
    governed = sorted(int(p.parent.parent.name[3:]) for p in root.glob("sys/devices/system/cpu/cpu*/cpufreq/scaling_governor"))
    if governor is None:
        assert governed == []
    else:
        assert governed == list(m.online_cpus)          # an offline CPU's policy is not readable
        assert {read(root, f"sys/devices/system/cpu/cpu{c}/cpufreq/scaling_governor") for c in governed} == {governor}


def test_one_session_unpacks_each_tree_once_for_all_its_processes(tmp_path):
    """The session's processes (xdist's workers, the pytest runs tests start) share the trees tests/conftest.py's
    directory holds: a second process finds the tree there (same inode, nothing unpacked again); a directory
    others may write, or a link, is never used: that process unpacks into one of its own."""
    import os
    import subprocess
    import sys

    import machine_trees

    shared = os.environ.get(machine_trees.SHARED_ENV)
    assert machine_trees.usable(shared), "tests/conftest.py names no shared directory"
    name = MACHINE_NAMES[0]
    tree = machine_tree(name)
    assert tree.parent == Path(shared)
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import machine_trees as m;"
            "print(m.machine_tree(sys.argv[2]), os.stat(m.machine_tree(sys.argv[2])).st_ino)")
    tests = str(Path(machine_trees.__file__).parent)

    def other_process(folder: str) -> tuple[Path, int]:
        env = {**os.environ, machine_trees.SHARED_ENV: folder}
        done = subprocess.run([sys.executable, "-c", code, tests, name], capture_output=True, text=True, env=env,
                              timeout=60, check=True)
        where, inode = done.stdout.split()
        return Path(where), int(inode)

    assert other_process(shared) == (tree, os.stat(tree).st_ino)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    (tmp_path / "link").symlink_to(shared)
    for folder in (open_to_all, tmp_path / "link"):
        where, _ = other_process(str(folder))
        assert where.parent != folder and where.parent != Path(shared) and not where.exists()   # its own, removed
    assert os.listdir(open_to_all) == []


def test_a_killed_sessions_directory_is_removed_by_the_next_one(tmp_path):
    """A session killed before its clean-up left its unpacked trees (107 MB of tmpfs; one from 2026-11-28 was
    still in /dev/shm): the next session removes this user's directories whose maker has ended, not a live one's."""
    import os
    import subprocess
    import sys
    import time

    import machine_trees

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    made = {}
    for label, owner, age in (("killed", dead.pid, 0), ("running", os.getpid(), 0),
                              ("old-unmarked", None, machine_trees.STALE_S + 60), ("new-unmarked", None, 0)):
        path = tmp_path / f"xlaunch-machines-{label}"
        (path / "tree").mkdir(parents=True, mode=0o700)
        path.chmod(0o700)
        if owner is not None:
            (path / machine_trees.OWNER).write_text(f"{owner}\n")
        os.utime(path, (time.time() - age, time.time() - age))
        made[label] = path
    assert sorted(p.name for p in machine_trees.remove_stale(tmp_path)) == \
        ["xlaunch-machines-killed", "xlaunch-machines-old-unmarked"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["xlaunch-machines-new-unmarked", "xlaunch-machines-running"]
