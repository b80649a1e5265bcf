"""record.py copies what the reader needs: re-reading a recording gives the same model."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

from xlaunch.launcher.machine import load_machine

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("xlaunch_record_tree", HERE / "record.py")
record_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_module)


def same_model(a, b) -> None:
    fields = ("cpus", "cores", "nodes", "l3_domains", "allowed_cpus", "allowed_mems", "cpu_budget", "notes")
    for name in fields:
        assert getattr(a, name) == getattr(b, name), name
    assert dataclasses.replace(a.isa, amx_permitted=None) == dataclasses.replace(b.isa, amx_permitted=None)


@pytest.mark.parametrize("name", ["offline-cpus", "vm-adjacent-smt", "vm-no-node", "hybrid-laptop"])
def test_rerecording_a_tree_keeps_the_model(tmp_path, name):
    out = tmp_path / name
    assert record_module.main([str(out), "--source", str(HERE / name)]) == 0
    same_model(load_machine(str(HERE / name)), load_machine(str(out)))


def test_records_the_cgroup_quota_on_the_process_path(tmp_path):
    source = tmp_path / "src"
    for relative, text in {"proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
                           "sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000\n",
                           "sys/fs/cgroup/other/cpu.max": "100 100000\n"}.items():
        (source / relative).parent.mkdir(parents=True, exist_ok=True)
        (source / relative).write_text(text)
    out = tmp_path / "out"
    assert record_module.main([str(out), "--source", str(source)]) == 0
    assert (out / "sys/fs/cgroup/kubepods/pod1/cpu.max").read_text() == "150000 100000\n"
    assert not (out / "sys/fs/cgroup/other").exists()
    assert load_machine(str(out)).cpu_budget == 1.5


def test_recording_this_machine(tmp_path):
    out = tmp_path / "here"
    assert record_module.main([str(out)]) == 0
    recorded = load_machine(str(out))
    live = load_machine("/")
    for name in ("cpus", "cores", "nodes", "l3_domains", "allowed_mems", "cpu_budget"):
        assert getattr(recorded, name) == getattr(live, name), name
    assert recorded.isa.flags == live.isa.flags
    # The recorder's own status file: the CPUs the recording process was allowed.
    assert recorded.allowed_cpus == tuple(sorted(os.sched_getaffinity(0)))


def test_refuses_an_existing_directory(tmp_path):
    with pytest.raises(SystemExit):
        record_module.main([str(tmp_path)])
