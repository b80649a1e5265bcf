"""Missing or odd sysfs/procfs files: the reader reports less, says why, and never crashes."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from machine_trees import machine_tree

from xlaunch.machine import MachineRootError, load_machine

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"


@pytest.fixture
def vm(tmp_path) -> Path:
    """A writable copy of the 8-vCPU VM (SMT pairs 0-1, 2-3, ...)."""
    root = tmp_path / "vm"
    shutil.copytree(machine_tree("vm-adjacent-smt"), root)
    return root


@pytest.fixture
def offline(tmp_path) -> Path:
    root = tmp_path / "offline"
    shutil.copytree(machine_tree("offline-cpus"), root)
    return root


def load(root: Path):
    return load_machine(str(root))


def cores(machine):
    return [c.cpus for c in machine.cores]


def test_intact_copy_has_no_notes(vm):
    m = load(vm)
    assert m.notes == () and cores(m) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_missing_thread_siblings_list_makes_that_cpu_its_own_core(vm):
    (vm / CPU / "cpu2/topology/thread_siblings_list").unlink()
    m = load(vm)
    assert cores(m) == [(0, 1), (2,), (3,), (4, 5), (6, 7)]
    assert any("cpu2" in n and "thread_siblings_list" in n for n in m.notes)


def test_missing_whole_topology_dirs(vm):
    for cpu in range(8):
        shutil.rmtree(vm / CPU / f"cpu{cpu}/topology")
    m = load(vm)
    assert cores(m) == [(c,) for c in range(8)]
    assert all(c.package is None and c.core_id is None for c in m.cpus)
    # One line for all the CPUs a note applies to (a 1024-CPU tree printed 2,048 lines).
    assert m.notes == ("cpu0-7: topology/thread_siblings_list missing; treated as its own core",
                       "cpu0-7: topology/physical_package_id missing; package unknown")


def test_missing_online_list_uses_per_cpu_online_files(offline):
    (offline / CPU / "online").unlink()
    m = load(offline)
    assert m.online_cpus == (0, 1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 14, 15)
    assert any("online" in n for n in m.notes)


def test_an_empty_online_list_is_damaged_not_a_machine_without_cpus(offline):
    """An empty cpu/online (the kernel always has a CPU online) made a machine with no CPU at all, and a
    plain dry run then failed with '--core-type: no performance core among the allowed CPUs'."""
    (offline / CPU / "online").write_text("\n")
    m = load(offline)
    assert m.online_cpus == (0, 1, 2, 4, 6, 7, 8, 9, 10, 11, 12, 14, 15) and len(m.cores) == 7
    assert any("online names no present CPU" in n for n in m.notes)
    for cpu in range(1, 16):
        (offline / CPU / f"cpu{cpu}/online").write_text("0\n")
    (offline / CPU / "cpu0/online").write_text("0\n")
    assert load(offline).online_cpus == tuple(range(16))     # nothing says 1: every present CPU


def test_missing_present_list_uses_cpu_directories(offline):
    (offline / CPU / "present").unlink()
    m = load(offline)
    assert [c.id for c in m.cpus] == list(range(16))
    assert len(m.cores) == 7


def test_garbage_lists_are_noted_not_raised(vm):
    (vm / CPU / "cpu0/topology/thread_siblings_list").write_text("zero-one\n")
    (vm / NODE / "node0/cpulist").write_text("0-\n")
    m = load(vm)
    assert (0,) in cores(m)
    assert m.node(0).cpus == ()
    assert any("unreadable list" in n for n in m.notes)


def test_missing_caches_give_no_l3(vm):
    for cpu in range(8):
        shutil.rmtree(vm / CPU / f"cpu{cpu}/cache")
    m = load(vm)
    assert m.l3_domains == () and all(c.l3 is None for c in m.cores)
    assert any("L3" in n for n in m.notes)


def test_bad_distance_and_missing_meminfo(vm):
    (vm / NODE / "node0/distance").write_text("10 20\n")   # two values for one node
    (vm / NODE / "node0/meminfo").unlink()
    m = load(vm)
    assert m.node(0).distances == () and m.node(0).memory_kib is None
    assert any("distance" in n for n in m.notes)


def test_node_online_naming_a_missing_directory(vm):
    (vm / NODE / "online").write_text("0-1\n")
    m = load(vm)
    assert [n.id for n in m.nodes] == [0]
    assert any("without a directory" in n for n in m.notes)


def test_missing_status_means_unrestricted(vm):
    (vm / "proc/self/status").unlink()
    m = load(vm)
    assert m.allowed_cpus == tuple(range(8)) and m.allowed_mems == (0,)
    assert any("status" in n for n in m.notes)


def test_status_without_lists(vm):
    (vm / "proc/self/status").write_text("Name:\tpython3\n")
    m = load(vm)
    assert m.allowed_cpus == tuple(range(8))
    assert any("Cpus_allowed_list" in n for n in m.notes)


def test_missing_cpuinfo_and_cgroup(vm):
    (vm / "proc/cpuinfo").unlink()
    (vm / "proc/self/cgroup").unlink()
    m = load(vm)
    assert m.isa.flags == frozenset() and m.cpu_budget is None
    assert any("cpuinfo" in n for n in m.notes) and any("cgroup" in n for n in m.notes)


def test_empty_root_still_gives_a_usable_machine(tmp_path):
    m = load_machine(str(tmp_path), live=False)
    assert m.online_cpus == (0,) and cores(m) == [(0,)]
    assert [n.id for n in m.nodes] == [0]
    assert len(m.notes) >= 3


def test_only_status_under_root_gives_its_cpus(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/status").write_text("Cpus_allowed_list:\t2-3\nMems_allowed_list:\t0\n")
    m = load_machine(str(tmp_path))
    assert m.online_cpus == (2, 3) and m.allowed_cpus == (2, 3)


def test_missing_root_raises_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XLAUNCH_FSROOT", str(tmp_path / "nope"))
    with pytest.raises(MachineRootError) as info:
        load_machine()
    message = str(info.value)
    assert "XLAUNCH_FSROOT" in message and "nope" in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_root_that_is_a_file_raises(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(MachineRootError, match="not a directory"):
        load_machine(str(file))


def test_fsroot_env_is_the_default_root(monkeypatch):
    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree("hybrid-laptop")))
    m = load_machine()
    assert m.is_hybrid and m.root == str(machine_tree("hybrid-laptop"))


def test_live_missing_cpuinfo_falls_back_to_py_cpuinfo(tmp_path, monkeypatch):
    """Live (non-Linux or sandboxed) without /proc/cpuinfo: flags come from py-cpuinfo, noted."""
    import sys
    import types

    from xlaunch.machine._files import Notes
    from xlaunch.machine.isa import read_isa

    fake = types.ModuleType("cpuinfo")
    fake.get_cpu_info = lambda: {"flags": ["avx2", "fma", "avx512_bf16"], "brand_raw": "Test CPU",
                                 "vendor_id_raw": "GenuineTest"}
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    notes = Notes()
    isa = read_isa(str(tmp_path), True, notes)
    assert isa.flags == {"avx2", "fma", "avx512_bf16"} and isa.model_name == "Test CPU"
    assert isa.amx_permitted is False
    assert any("py-cpuinfo" in n for n in notes.as_tuple())


def test_live_fallback_failure_is_a_note(tmp_path, monkeypatch):
    import sys
    import types

    from xlaunch.machine._files import Notes
    from xlaunch.machine.isa import read_isa

    fake = types.ModuleType("cpuinfo")

    def broken():
        raise RuntimeError("no CPUID here")

    fake.get_cpu_info = broken
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    notes = Notes()
    assert read_isa(str(tmp_path), True, notes).flags == frozenset()
    assert any("no CPUID here" in n for n in notes.as_tuple())
