"""xlaunch.node_copies: which NUMA node a process's CPUs make its home (recorded machines), the node copy
written once beside the file (or in the cache), reused, replaced when the file changes, never written through a
planted link, and written once when two processes of the node ask at the same time."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from machine_trees import machine_tree

from xlaunch import node_copies
from xlaunch.machine import load_machine
from xlaunch.node_copies import NodeCopyError, home_node, node_copy, placed

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, cpus, home", [
    ("xeon-2s-amx", {0, 1}, 0), ("xeon-2s-amx", {56, 57}, 1), ("xeon-2s-amx", {0, 56}, None),
    ("epyc-4node-nps4", {16, 17}, 1), ("epyc-4node-nps4", {1, 2, 3}, 0), ("epyc-4node-nps4", {0, 16, 32}, None),
    ("xeon-max-snc4-hbm", {8}, 1),                 # four SNC nodes with CPUs, four HBM nodes without
    ("spr16", {0, 1}, None), ("memory-only-node", {0, 1}, None),      # one node with CPUs: nothing to place
    ("container-cpuset", {4, 5}, None),
])
def test_the_home_node_is_the_one_node_of_every_cpu_on_a_machine_of_several(name, cpus, home):
    assert home_node(load_machine(str(machine_tree(name))), cpus) == home


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "m.xlp"
    path.parent.mkdir()
    path.write_bytes(os.urandom(3 << 20) + b"tail")
    return path


def copies(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".m.xlp.node") and not p.name.endswith(".lock"))


def test_a_copy_is_written_once_beside_the_file_and_replaced_when_the_file_changes(weights):
    first = node_copy(weights, 1)
    assert first.parent == weights.parent and first.name.startswith(".m.xlp.node1.")
    assert first.read_bytes() == weights.read_bytes()
    written = first.stat().st_mtime_ns
    assert node_copy(weights, 1) == first and first.stat().st_mtime_ns == written      # reused, not rewritten
    other = node_copy(weights, 0)
    assert other != first and other.read_bytes() == weights.read_bytes()             # each node its own
    weights.write_bytes(b"changed" + os.urandom(1 << 20))
    fresh = node_copy(weights, 1)
    assert fresh != first and fresh.read_bytes() == weights.read_bytes()
    assert copies(weights.parent) == sorted([fresh.name, other.name])                 # node 1's old copy removed


def test_an_unwritable_folder_sends_the_copy_to_the_cache(weights, tmp_path, monkeypatch):
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(node_copies, "_writable", lambda folder: False)
    copy = node_copy(weights, 0)
    assert copy.is_relative_to(tmp_path / "cache" / "node-copies") and copy.read_bytes() == weights.read_bytes()
    assert copies(weights.parent) == []


def test_a_link_planted_at_the_copys_name_is_replaced_never_followed(weights, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = weights.parent / f".m.xlp.node0.{node_copies._key(weights)}"
    target.symlink_to(victim)
    copy = node_copy(weights, 0)
    assert copy == target and not copy.is_symlink() and copy.read_bytes() == weights.read_bytes()
    assert victim.read_bytes() == b"keep" and not list(weights.parent.glob("*.tmp"))


def test_a_link_at_the_lock_or_a_non_regular_file_is_one_error(weights, tmp_path):
    Path(weights.parent / ".m.xlp.node3.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NodeCopyError, match="a node-local copy of .*m.xlp") as info:
        node_copy(weights, 3)
    assert "\n" not in str(info.value) and not (tmp_path / "elsewhere").exists()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NodeCopyError, match="not a regular file"):
        node_copy(tmp_path / "fifo", 0)


TWO_AT_ONCE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from xlaunch import node_copies
written = []
original = node_copies._write
node_copies._write = lambda *args: (written.append(1), time.sleep(0.3), original(*args))
print(node_copies.node_copy(sys.argv[2], 0), len(written))
"""


def test_two_processes_of_a_node_asking_at_once_write_one_copy(weights):
    procs = [subprocess.Popen([sys.executable, "-c", TWO_AT_ONCE, str(REPO), str(weights)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    paths, counts = zip(*(out.strip().rsplit(" ", 1) for out, _ in outs))     # a path may hold spaces
    assert paths[0] == paths[1] and sorted(counts) == ["0", "1"], outs
    assert copies(weights.parent) == [Path(paths[0]).name]


def test_placed_is_the_file_itself_on_one_node_and_the_nodes_copy_on_two(weights, monkeypatch):
    """This process's CPUs on a recorded 2-socket Xeon (XLAUNCH_FSROOT): node 0's copy; on this machine's own
    tree (or a 1-node recording): the file."""
    from xlaunch.machine import clear_cache

    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree("spr16")))
    clear_cache()
    assert placed(weights) == weights
    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree("xeon-2s-amx")))
    cpus = os.sched_getaffinity(0)
    if not cpus <= set(range(56)) and not cpus <= set(range(56, 112)):
        pytest.skip(f"this process's CPUs {sorted(cpus)} span the recorded machine's two nodes")
    try:
        copy = placed(weights)
    finally:
        clear_cache()
    assert copy.name.startswith(f".m.xlp.node{0 if cpus <= set(range(56)) else 1}.")
    assert copy.read_bytes() == weights.read_bytes()


def test_a_copy_of_the_right_size_another_user_could_have_written_is_rewritten(weights):
    target = weights.parent / f".m.xlp.node0.{node_copies._key(weights)}"
    target.write_bytes(b"X" * weights.stat().st_size)          # other weights, of the file's size
    target.chmod(0o666)                                        # anyone could have written it
    copy = node_copy(weights, 0)
    assert copy == target and copy.read_bytes() == weights.read_bytes()
    if os.geteuid() == 0:                                      # planted by another user (uid 65534)
        os.chown(target, 65534, 65534)
        target.write_bytes(b"Y" * weights.stat().st_size)
        target.chmod(0o644)
        assert node_copy(weights, 0).read_bytes() == weights.read_bytes()


def test_a_cache_folder_others_may_write_is_one_error(weights, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                                        # XLAUNCH_CACHE_DIR under an open /tmp folder
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(shared))
    monkeypatch.setattr(node_copies, "_writable", lambda folder: False)
    with pytest.raises(NodeCopyError, match="another user could replace it .*mode 777") as info:
        node_copy(weights, 0)
    assert "\n" not in str(info.value)
    assert not [path for path in shared.rglob("*") if path.is_file()]
