"""Hostile files where the reader expects a small sysfs/procfs file: FIFOs, devices, directories,
symlink loops, binary garbage, non-ASCII digits. The reader never hangs and never raises: it
ignores the file with one bounded note naming it, and says what it assumed instead."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from machine_trees import machine_tree

from xlaunch.machine import load_machine, memory_available
from xlaunch.machine._files import list_numbered

CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"
V1_QUOTA = "sys/fs/cgroup/cpu,cpuacct/docker/3f1c2ab9d0e4/cpu.cfs_quota_us"   # 600000 / 100000 there
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def vm(tmp_path) -> Path:
    """A writable copy of the 8-vCPU VM (SMT pairs 0-1, ...; cgroup v1 quota of 6 CPUs)."""
    root = tmp_path / "vm"
    shutil.copytree(machine_tree("vm-adjacent-smt"), root)
    return root


def replace(root: Path, relative: str) -> Path:
    path = root / relative
    path.unlink()
    return path


FIFO_PLACES = (f"{CPU}/present", f"{CPU}/online", "proc/cpuinfo", "proc/self/status",
               V1_QUOTA, f"{CPU}/cpu0/topology/thread_siblings_list")


def load_within(root: Path, seconds: float):
    """``load_machine(root)`` in a daemon thread: a reader stuck on a FIFO fails the test, not the run."""
    done: dict[str, object] = {}
    thread = threading.Thread(target=lambda: done.update(machine=load_machine(str(root))), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the reader is waiting on a FIFO"
    return done["machine"]


def test_a_fifo_is_noted_not_waited_on(vm):
    paths = [replace(vm, relative) for relative in FIFO_PLACES]
    for path in paths:
        os.mkfifo(path)
    m = load_within(vm, 10)
    for path in paths:
        assert f"{path} is a FIFO, not a regular file; ignored" in m.notes
    assert [c.id for c in m.cpus] == list(range(8)) and m.allowed_cpus == tuple(range(8))
    assert m.isa.flags == frozenset() and m.cpu_budget is None


def test_device_directory_and_symlink_loop_are_noted(vm):
    os.symlink("/dev/zero", replace(vm, "proc/self/status"))
    replace(vm, f"{CPU}/present").mkdir()
    loop = replace(vm, f"{NODE}/node0/meminfo")
    os.symlink(loop.name, loop)
    m = load_machine(str(vm))
    assert f"{vm}/proc/self/status is a character device, not a regular file; ignored" in m.notes
    assert f"{vm}/{CPU}/present is a directory, not a regular file; ignored" in m.notes
    assert any(n.startswith(f"{loop}: ") and "symbolic links" in n for n in m.notes)
    assert [c.id for c in m.cpus] == list(range(8)) and m.allowed_cpus == tuple(range(8))
    assert m.node(0).memory_kib is None


NON_ASCII = {
    f"{CPU}/cpu0/cache/index3/size": "\u00b2K",
    f"{CPU}/cpu0/topology/core_id": "\u0661",       # Arabic-Indic one: int() takes it, sysfs never writes it
    f"{NODE}/node0/distance": "\u00b9\u2070",
    f"{NODE}/node0/meminfo": "Node 0 MemTotal:  \u00b2\u00b3 kB\n",
    V1_QUOTA: "\u00b2",
}


def test_non_ascii_digits_are_not_numbers(vm):
    for relative, text in NON_ASCII.items():
        (vm / relative).write_text(text)
    m = load_machine(str(vm))          # before: ValueError from int() deep in the reader
    assert len(m.cores) == 4 and m.cpu(0).core_id is None
    assert m.l3_domains[0].size_kib is None and m.node(0).distances == () and m.node(0).memory_kib is None
    assert m.cpu_budget is None and f"{vm}/{V1_QUOTA}: '\u00b2 / 100000' is not a CPU quota; ignored" in m.notes
    (vm / V1_QUOTA).write_text("600000")
    (vm / V1_QUOTA.replace("quota", "period")).write_text("1\u00b2")
    assert load_machine(str(vm)).cpu_budget is None


def test_memory_available_ignores_non_ascii_digits(vm):
    (vm / "proc/meminfo").write_text("MemTotal: 100 kB\nMemAvailable: \u00b2\u00b3 kB\n")
    assert memory_available(str(vm)) is None
    (vm / "proc/meminfo").write_text("MemTotal: 100 kB\nMemAvailable: 23 kB\n")
    assert memory_available(str(vm)) == 23 * 1024


def test_cpu_directories_are_the_kernels_names_only(tmp_path):
    for name in ("cpu0", "cpu1", "cpu01", "cpu\u00b2", "cpu\u0663", "cpufreq", "cpu"):
        (tmp_path / name).mkdir()
    assert list_numbered(str(tmp_path), "cpu") == [0, 1]


def test_garbage_quota_is_noted_not_silently_unlimited(vm):
    (vm / V1_QUOTA).write_text("lots\n")
    m = load_machine(str(vm))
    assert m.cpu_budget is None
    assert f"{vm}/{V1_QUOTA}: 'lots / 100000' is not a CPU quota; ignored" in m.notes
    (vm / V1_QUOTA).write_text("0\n")         # below the kernel's 1 ms minimum
    assert load_machine(str(vm)).cpu_budget is None
    (vm / V1_QUOTA).write_text("-1\n")        # the kernel's "no limit"
    assert load_machine(str(vm)).notes == ()


def test_garbage_status_is_noted(vm):
    (vm / "proc/self/status").write_bytes(bytes(range(256)).replace(b":", b"") * 64)   # no "Key:" line
    m = load_machine(str(vm))
    assert m.allowed_cpus == tuple(range(8)) and m.allowed_mems == (0,)
    assert "proc/self/status has no Cpus_allowed_list; assumed unrestricted" in m.notes


def test_empty_mems_allowed_list_is_every_memory_node(vm):
    status = vm / "proc/self/status"
    status.write_text(status.read_text().replace("Mems_allowed_list:\t0", "Mems_allowed_list:\t"))
    m = load_machine(str(vm))
    assert m.allowed_mems == (0,)
    assert any("Mems_allowed_list is empty" in n for n in m.notes)


def test_a_huge_garbage_list_gives_a_short_note(vm):
    (vm / f"{CPU}/online").write_bytes(bytes(range(1, 256)) * 256)
    m = load_machine(str(vm))
    assert m.online_cpus == tuple(range(8))       # each cpuN/online then (missing: online)
    assert m.notes and all(len(n) < 400 for n in m.notes)


def test_the_launcher_plans_past_a_fifo(vm):
    """As a user runs it: --show-topology over a tree holding a FIFO finishes, exit 0, with the note."""
    os.mkfifo(replace(vm, f"{CPU}/present"))
    env = {**os.environ, "XLAUNCH_FSROOT": str(vm), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "xlaunch", "--show-topology", "--json"], env=env,
                            capture_output=True, text=True, timeout=30, cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    notes = json.loads(result.stdout)["notes"]
    assert f"{vm}/{CPU}/present is a FIFO, not a regular file; ignored" in notes


def test_a_file_too_large_is_ignored_not_cut_into_a_shorter_list(vm):
    """Cut at 64 KiB, a list lost its tail and still parsed: '00,1,1,...,1,2-7' read as CPUs 0-1 online."""
    online = vm / CPU / "online"
    online.write_text("00" + ",1" * 40000 + ",2-7\n")          # valid, but 80 KB: no kernel writes that
    m = load_machine(str(vm))
    assert f"{online} is larger than 65536 bytes; ignored" in m.notes
    assert m.online_cpus == tuple(range(8))                  # from each cpuN/online, not the cut '0-1,...'
