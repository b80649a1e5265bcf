"""cgroup CPU budgets, current_machine caching, and the ldconfig cache / library search."""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from machine_trees import machine_tree

from xlaunch.machine import clear_cache, current_machine, load_machine
from xlaunch.machine._files import Notes
from xlaunch.machine.libraries import find_libraries, parse_ld_cache, read_ld_conf
from xlaunch.machine.limits import read_cpu_budget
from xlaunch.machine.report import format_topology, topology_json



def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def budget(root: Path):
    return read_cpu_budget(str(root), Notes())


def test_v2_takes_the_tightest_ancestor(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "400000 100000\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/cpu.max", "max 100000\n")
    assert budget(tmp_path) == 1.5


def test_v2_max_is_unlimited(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/a\n")
    write(tmp_path, "sys/fs/cgroup/a/cpu.max", "max 100000\n")
    assert budget(tmp_path) is None


def test_v2_hybrid_mount_under_unified(tmp_path):
    write(tmp_path, "proc/self/cgroup", "1:name=systemd:/x\n0::/x\n")
    write(tmp_path, "sys/fs/cgroup/unified/x/cpu.max", "50000 100000\n")
    assert budget(tmp_path) == 0.5


def test_v1_cfs_quota_with_reversed_mount_name(tmp_path):
    write(tmp_path, "proc/self/cgroup", "3:cpuacct,cpu:/job\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us", "300000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n")
    assert budget(tmp_path) == 3.0


def test_v1_namespaced_path_falls_back_to_the_mount_root(tmp_path):
    write(tmp_path, "proc/self/cgroup", "3:cpu:/docker/abc\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "200000\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert budget(tmp_path) == 2.0


def test_a_path_outside_the_cgroup_namespace_reads_no_quota(tmp_path):
    """'/../other' dropped the '..' and read other/cpu.max and the namespace root's, neither on its path."""
    write(tmp_path, "proc/self/cgroup", "0::/../other\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "200000 100000\n")
    write(tmp_path, "sys/fs/cgroup/other/cpu.max", "50000 100000\n")
    notes = Notes()
    assert read_cpu_budget(str(tmp_path), notes) is None
    assert notes.as_tuple() == ("proc/self/cgroup: '/../other' is outside this cgroup namespace; its CPU quota "
                                "is unknown",)


def test_cgroup_names_with_spaces(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/system.slice/my job .scope\n")
    write(tmp_path, "sys/fs/cgroup/system.slice/my job .scope/cpu.max", "150000 100000\n")
    write(tmp_path, "sys/fs/cgroup/system.slice/cpu.max", "max 100000\n")
    assert budget(tmp_path) == 1.5


@pytest.mark.parametrize("text", ["", "garbage", "100000", "-1 100000", "100 0"])
def test_odd_cpu_max_is_ignored(tmp_path, text):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", text)
    assert budget(tmp_path) is None


def test_isolated_cpus_outside_the_affinity_are_named(tmp_path):
    """isolcpus= takes CPUs out of every process's default affinity: the plan used the others and
    neither --show-topology nor the notes said why half the machine sat idle."""
    root = tmp_path / "box"
    shutil.copytree(machine_tree("offline-cpus"), root)          # 16 CPUs, 3, 5 and 13 offline
    write(root, "sys/devices/system/cpu/isolated", "8-15\n")
    status = root / "proc/self/status"
    status.write_text(status.read_text().replace("Cpus_allowed_list:\t0-15", "Cpus_allowed_list:\t0-7"))
    m = load_machine(str(root))
    assert m.isolated_cpus == (8, 9, 10, 11, 12, 14, 15) and m.allowed_cpus == (0, 1, 2, 4, 6, 7)
    assert ("CPUs 8-12,14-15 are isolated (isolcpus=) and not in this process's affinity: used only where "
            "--cores-list names them") in m.notes
    assert "Isolated CPUs (isolcpus=): 8-12,14-15" in format_topology(m)
    assert topology_json(m)["isolated_cpus"] == [8, 9, 10, 11, 12, 14, 15]
    status.write_text(status.read_text().replace("Cpus_allowed_list:\t0-7", "Cpus_allowed_list:\t8-15"))
    assert not any("isolated" in n for n in load_machine(str(root)).notes)   # run under taskset: in use
    write(root, "sys/devices/system/cpu/isolated", "\n")                       # the kernel's "none"
    assert load_machine(str(root)).isolated_cpus == ()


def test_current_machine_is_cached_per_root(monkeypatch):
    clear_cache()
    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree("container-cpuset")))
    first = current_machine()
    assert first is current_machine()
    assert first.allowed_cpus == (4, 5, 6, 7, 36, 37, 38, 39)
    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree("hybrid-laptop")))
    assert current_machine().is_hybrid
    clear_cache()


def _new_cache(entries: list[tuple[int, str, str]]) -> bytes:
    """Build a glibc ``glibc-ld.so.cache1.1`` file the way ldconfig lays it out."""
    header = 48
    strings = b""
    offsets = []
    table_start = header + 24 * len(entries)
    for _, key, value in entries:
        k = table_start + len(strings)
        strings += key.encode() + b"\0"
        v = table_start + len(strings)
        strings += value.encode() + b"\0"
        offsets.append((k, v))
    out = b"glibc-ld.so.cache" + b"1.1" + struct.pack("<IIB3xI12x", len(entries), len(strings), 2, 0)
    assert len(out) == header
    for (flags, _, _), (k, v) in zip(entries, offsets):
        out += struct.pack("<iIIIQ", flags, k, v, 0, 0)
    return out + strings


def _old_cache(entries: list[tuple[int, str, str]]) -> bytes:
    strings = b""
    packed = b""
    for flags, key, value in entries:
        k = len(strings)
        strings += key.encode() + b"\0"
        v = len(strings)
        strings += value.encode() + b"\0"
        packed += struct.pack("<iII", flags, k, v)
    return b"ld.so-1.7.0\0" + struct.pack("<I", len(entries)) + packed + strings


ENTRIES = [(0x0303, "libjemalloc.so.2", "/opt/x/libjemalloc.so.2"),
           (0x0303, "libz.so.1", "/lib/libz.so.1"),
           (0x0003, "libgomp.so.1", "/lib32/libgomp.so.1")]


@pytest.mark.parametrize("build", [_new_cache, _old_cache])
def test_parse_ld_cache_formats(build):
    assert parse_ld_cache(build(ENTRIES)) == ENTRIES
    assert parse_ld_cache(build(ENTRIES), wanted={"libjemalloc.so.2"}) == ENTRIES[:1]


def test_parse_ld_cache_old_followed_by_new_section():
    # ldconfig's compat layout: old header and entries, then (8-aligned) the new section,
    # whose string offsets count from its own start.
    old = b"ld.so-1.7.0\0" + struct.pack("<I", 1) + struct.pack("<iII", 0x0303, 0, 0)
    padded = old + b"\0" * ((-len(old)) % 8)
    assert parse_ld_cache(padded + _new_cache(ENTRIES)) == ENTRIES


@pytest.mark.parametrize("data", [b"", b"garbage", b"glibc-ld.so.cache1.1" + b"\xff" * 40])
def test_parse_ld_cache_garbage_is_empty(data):
    assert parse_ld_cache(data) == []


def test_real_ld_cache_parses():
    if not os.path.isfile("/etc/ld.so.cache"):
        pytest.skip("no /etc/ld.so.cache")
    with open("/etc/ld.so.cache", "rb") as handle:
        entries = parse_ld_cache(handle.read())
    assert entries and all(path.startswith("/") for _, _, path in entries)
    assert any(key.startswith("libc.so") for _, key, _ in entries)


def _fake_lib(directory: Path, name: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(b"\x7fELF")
    return str(directory / name)


def test_search_order_and_versioned_names(tmp_path):
    venv = _fake_lib(tmp_path / "venv/lib", "libiomp5.so")
    conda = _fake_lib(tmp_path / "conda/lib", "libjemalloc.so.2")
    ldpath = _fake_lib(tmp_path / "ld", "libtcmalloc_minimal.so.4")
    system_jemalloc = _fake_lib(tmp_path / "sys", "libjemalloc.so.2")
    omp = _fake_lib(tmp_path / "sys", "libomp.so.5")
    cached = _fake_lib(tmp_path / "cached", "libgomp.so.1")
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(_new_cache([(0x0303, "libgomp.so.1", cached)]))
    found = find_libraries(
        {"CONDA_PREFIX": str(tmp_path / "conda"), "LD_LIBRARY_PATH": f"{tmp_path / 'ld'}:"},
        prefixes=[str(tmp_path / "venv")], ld_cache=str(cache), system_dirs=[str(tmp_path / "sys")],
    )
    assert [(lib.kind, lib.path, lib.source) for lib in found] == [
        ("iomp", venv, "venv"),
        ("jemalloc", conda, "conda"),
        ("tcmalloc_minimal", ldpath, "LD_LIBRARY_PATH"),
        ("gomp", cached, "ldconfig"),
        ("jemalloc", system_jemalloc, "system"),
        ("omp", omp, "system"),
    ]


def test_ld_conf_is_used_without_a_cache(tmp_path):
    lib = _fake_lib(tmp_path / "extra", "libtcmalloc.so.4")
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d/x.conf").write_text(f"# comment\n{tmp_path / 'extra'}\n")
    (tmp_path / "ld.so.conf").write_text("include conf.d/*.conf\n")
    assert read_ld_conf(str(tmp_path / "ld.so.conf")) == [str(tmp_path / "extra")]
    found = find_libraries({}, prefixes=[], ld_cache=str(tmp_path / "none"),
                           ld_conf=str(tmp_path / "ld.so.conf"), system_dirs=[])
    assert [(lib.kind, lib.path, lib.source) for lib in found] == [("tcmalloc", lib, "ld.so.conf")]


def test_same_file_through_two_dirs_is_listed_once(tmp_path):
    real = _fake_lib(tmp_path / "real", "libjemalloc.so.2")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    found = find_libraries({"LD_LIBRARY_PATH": f"{tmp_path / 'real'}:{tmp_path / 'link'}"},
                           prefixes=[], ld_cache=str(tmp_path / "none"), ld_conf=str(tmp_path / "none"),
                           system_dirs=[])
    assert [lib.path for lib in found] == [real]


def test_machine_library_prefers_the_first_found():
    m = load_machine(str(machine_tree("vm-no-node")))
    for lib in m.libraries:
        assert m.library(lib.kind).path == next(x.path for x in m.libraries if x.kind == lib.kind)
