"""xlaunch-record-machine copies what the reader needs: re-reading a recording gives the same
model, as a directory or as a .tar.xz that XLAUNCH_FSROOT takes as is."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from machine_trees import ARCHIVES, machine_tree

from xlaunch._records import replace
from xlaunch.machine import MachineRootError, load_machine
from xlaunch.machine.archive import unpack_archive, write_archive
from xlaunch.machine.record import main as record_main

REPO = Path(__file__).resolve().parents[2]
HOST_FILES = ("sys/kernel/mm/transparent_hugepage/enabled", "sys/kernel/mm/transparent_hugepage/defrag",
              "sys/devices/system/cpu/smt/control", "sys/devices/system/cpu/smt/active")


def same_model(a, b) -> None:
    fields = ("cpus", "cores", "nodes", "l3_domains", "allowed_cpus", "allowed_mems", "cpu_budget", "isolated_cpus",
              "notes")
    for name in fields:
        assert getattr(a, name) == getattr(b, name), name
    assert replace(a.isa, amx_permitted=None) == replace(b.isa, amx_permitted=None)


@pytest.mark.parametrize("name", ["offline-cpus", "vm-adjacent-smt", "vm-no-node", "hybrid-laptop"])
def test_rerecording_a_tree_keeps_the_model_and_the_host_files(tmp_path, name):
    source = machine_tree(name)
    out = tmp_path / name
    assert record_main([str(out), "--source", str(source)]) == 0
    same_model(load_machine(str(source)), load_machine(str(out)))
    for relative in [*HOST_FILES, "proc/sys/kernel/numa_balancing"]:
        assert (out / relative).exists() == (source / relative).exists(), relative
        if (source / relative).exists():
            assert (out / relative).read_bytes() == (source / relative).read_bytes(), relative
    governors = sorted(p.relative_to(source) for p in source.glob("sys/devices/system/cpu/cpu*/cpufreq/*"))
    assert governors == sorted(p.relative_to(out) for p in out.glob("sys/devices/system/cpu/cpu*/cpufreq/*"))


def test_an_empty_cpufreq_directory_is_recorded(tmp_path):
    """A VM's kernel shows ``cpu/cpufreq/`` with no policy: "no frequency driver" (``none``),
    which a recording without the directory would turn into ``unknown``."""
    import shutil

    source = tmp_path / "vm"
    shutil.copytree(machine_tree("vm-adjacent-smt"), source)
    (source / "sys/devices/system/cpu/cpufreq").mkdir()
    assert load_machine(str(source)).host.governors == (("none", 8),)
    out = tmp_path / "recorded"
    assert record_main([str(out), "--source", str(source)]) == 0
    assert (out / "sys/devices/system/cpu/cpufreq").is_dir()
    assert load_machine(str(out)).host.governors == (("none", 8),)


def test_archive_round_trip_and_fsroot_takes_the_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = machine_tree("vm-adjacent-smt")
    out = tmp_path / "box"
    assert record_main([str(out), "--archive", "--source", str(source)]) == 0
    archive = tmp_path / "box.tar.xz"
    assert archive.is_file() and not out.exists()
    unpack_archive(str(archive), str(tmp_path / "unpacked"))
    same_model(load_machine(str(source)), load_machine(str(tmp_path / "unpacked")))
    # XLAUNCH_FSROOT=<archive>: unpacked once into the cache, keyed by content.
    monkeypatch.setenv("XLAUNCH_FSROOT", str(archive))
    first = load_machine()
    same_model(load_machine(str(source)), first)
    assert Path(first.root).parent == tmp_path / "cache" / "xlaunch" / "machines"
    assert load_machine(str(archive)).root == first.root
    assert len(os.listdir(tmp_path / "cache" / "xlaunch" / "machines")) == 1


def test_unpacking_completes_writes_that_stop_short(tmp_path, monkeypatch):
    """A write may take fewer bytes than asked (a signal mid-write, a nearly full disk): every file
    still arrives whole (the unpacker once counted a short write as complete)."""
    tree = machine_tree("vm-adjacent-smt")
    write_archive(str(tree), str(tmp_path / "box.tar.xz"))
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    unpack_archive(str(tmp_path / "box.tar.xz"), str(tmp_path / "unpacked"))
    monkeypatch.undo()
    files = sorted(p.relative_to(tree) for p in tree.rglob("*") if p.is_file())
    assert files and all((tmp_path / "unpacked" / f).read_bytes() == (tree / f).read_bytes() for f in files)


def test_the_cli_dry_runs_on_an_archive(tmp_path):
    archive = ARCHIVES / "hybrid-laptop.tar.xz"
    env = {**os.environ, "XLAUNCH_FSROOT": str(archive), "XDG_CACHE_HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "xlaunch", "--dry-run", "--json", "--core-type", "efficiency",
            "--no-python", "true"]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [i["cpus"] for i in json.loads(result.stdout)["instances"]] == [list(range(8, 16))]


def test_archives_are_reproducible(tmp_path):
    tree = machine_tree("vm-no-node")
    write_archive(str(tree), str(tmp_path / "a.tar.xz"))
    write_archive(str(tree), str(tmp_path / "b.tar.xz"))
    digest = [hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("a.tar.xz", "b.tar.xz")]
    assert digest[0] == digest[1]
    with tarfile.open(tmp_path / "a.tar.xz") as tar:
        members = tar.getmembers()
    assert {m.mtime for m in members} == {0} and {m.uname for m in members} == {""}
    # the committed archive holds the same tree (make_trees.py wrote it the same way)
    assert (ARCHIVES / "vm-no-node.tar.xz").read_bytes() == (tmp_path / "a.tar.xz").read_bytes()


@pytest.mark.parametrize("suffix, mode", [(".tar.gz", "w:gz"), (".tar", "w")])
def test_gzip_and_plain_tar_archives_are_read_too(tmp_path, monkeypatch, suffix, mode):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree = machine_tree("vm-no-node")
    archive = tmp_path / f"box{suffix}"
    with tarfile.open(archive, mode) as tar:         # made by tarfile's own writer, not ours
        for top in ("sys", "proc"):
            tar.add(tree / top, arcname=top)
    same_model(load_machine(str(tree)), load_machine(str(archive)))


@pytest.mark.parametrize("member", ["../escape", "link"])
def test_unsafe_archives_are_refused(tmp_path, member, monkeypatch):
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        info = tarfile.TarInfo(member)
        if member == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
            info = tarfile.TarInfo("link/x")            # write through the link
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(MachineRootError, match="cannot be unpacked"):
        load_machine(str(bad))
    assert not (tmp_path / "escape").exists()


def test_no_writable_cache_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    """An archive root with no cache to unpack into (HOME unset or read-only in a container) said only
    '[Errno 2] No such file or directory: ...', not which directory it wanted or how to get past it."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    with pytest.raises(MachineRootError) as raised:
        load_machine(str(ARCHIVES / "vm-no-node.tar.xz"))
    message = str(raised.value)
    assert f"no place to unpack it: {tmp_path}/file/cache/xlaunch/machines: Not a directory" in message
    assert "XDG_CACHE_HOME" in message and "\n" not in message


def test_a_damaged_archive_is_one_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "cut.tar.xz"
    bad.write_bytes((ARCHIVES / "offline-cpus.tar.xz").read_bytes()[:500])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(MachineRootError, match="cannot be unpacked"):
        load_machine(str(bad))
    assert os.listdir(tmp_path / "cache" / "xlaunch" / "machines") == []   # no half-unpacked root


def test_records_the_cgroup_quota_on_the_process_path(tmp_path):
    source = tmp_path / "src"
    for relative, text in {"proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
                           "sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000\n",
                           "sys/fs/cgroup/other/cpu.max": "100 100000\n"}.items():
        (source / relative).parent.mkdir(parents=True, exist_ok=True)
        (source / relative).write_text(text)
    out = tmp_path / "out"
    assert record_main([str(out), "--source", str(source)]) == 0
    assert (out / "sys/fs/cgroup/kubepods/pod1/cpu.max").read_text() == "150000 100000\n"
    assert not (out / "sys/fs/cgroup/other").exists()
    assert load_machine(str(out)).cpu_budget == 1.5


def test_recording_this_machine(tmp_path):
    out = tmp_path / "here"
    assert record_main([str(out)]) == 0
    recorded = load_machine(str(out))
    live = load_machine("/")
    for name in ("cpus", "cores", "nodes", "l3_domains", "allowed_mems", "cpu_budget"):
        assert getattr(recorded, name) == getattr(live, name), name
    assert recorded.isa.flags == live.isa.flags
    # The recorder's own status file: the CPUs the recording process was allowed.
    assert recorded.allowed_cpus == tuple(sorted(os.sched_getaffinity(0)))
    for relative in HOST_FILES:
        if os.path.exists(f"/{relative}"):
            assert (out / relative).read_bytes() == Path(f"/{relative}").read_bytes(), relative


@pytest.mark.parametrize("archive", [False, True])
def test_refuses_an_existing_target(tmp_path, archive, capsys):
    (tmp_path / "x.tar.xz").write_text("")
    target = tmp_path / ("x" if archive else "")
    with pytest.raises(SystemExit) as exit_info:
        record_main([str(target), *(["--archive"] if archive else [])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("xlaunch-record-machine: error: DIR: ") and "already exists" in err


def test_archives_are_streamed_member_by_member_and_capped(tmp_path, monkeypatch):
    """Concatenated gzip members and xz streams are read as gzip -d and xz -d read them; past the
    member cap the archive is refused and what was unpacked is removed. (The size cap, against a
    600 MB bomb in bounded memory, runs through the CLI: tests/launcher/cli/test_hostile_input.py.)"""
    import gzip
    import lzma

    from xlaunch.machine import archive

    tree = machine_tree("vm-no-node")
    plain = tmp_path / "box.tar"
    write_archive(str(tree), str(tmp_path / "box.tar.xz"))
    plain.write_bytes(lzma.decompress((tmp_path / "box.tar.xz").read_bytes()))
    raw = plain.read_bytes()
    half = len(raw) // 2
    (tmp_path / "two.tar.gz").write_bytes(gzip.compress(raw[:half]) + gzip.compress(raw[half:]))
    (tmp_path / "two.tar.xz").write_bytes(lzma.compress(raw[:half]) + bytes(4) + lzma.compress(raw[half:]))
    for name in ("two.tar.gz", "two.tar.xz"):
        unpack_archive(str(tmp_path / name), str(tmp_path / f"out-{name}"))
        same_model(load_machine(str(tree)), load_machine(str(tmp_path / f"out-{name}")))
    members = len(tarfile.open(plain).getmembers())
    monkeypatch.setattr(archive, "MAX_MEMBERS", members - 1)
    with pytest.raises(ValueError, match=f"more than {members - 1} members"):
        unpack_archive(str(plain), str(tmp_path / "capped"))
    assert not (tmp_path / "capped").exists()


def test_a_source_that_is_not_a_machine_root_is_one_line_and_an_interrupt_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A ``--source`` that is missing or holds nothing to record said so without naming the option, exit 1; a
    Ctrl-C while recording left the half-written folder or archive (a later run then refused it as existing)."""
    (tmp_path / "empty").mkdir()
    for source, problem in (("missing", "is not a directory"), ("empty", None)):
        with pytest.raises(SystemExit) as stopped:
            record_main([str(tmp_path / "out"), "--source", str(tmp_path / source)])
        assert stopped.value.code == 2 and not (tmp_path / "out").exists()
        line = f"{tmp_path / source} {problem}" if problem else f"nothing readable under {tmp_path / source}"
        assert capsys.readouterr().err == f"xlaunch-record-machine: error: --source: {line}\n"
    import xlaunch.machine.record as record

    source = machine_tree("vm-no-node")
    for archive, writer in ((False, "record"), (True, "record_archive")):
        real = getattr(record, writer)

        def interrupted(src, target, real=real):
            real(src, target)              # written, then the Ctrl-C lands before the command returns
            raise KeyboardInterrupt

        monkeypatch.setattr(record, writer, interrupted)
        out = tmp_path / f"interrupted-{archive}"
        assert record_main([str(out), "--source", str(source), *(["--archive"] if archive else [])]) == 130
        assert list(tmp_path.glob("interrupted-*")) == []


def test_a_fifo_or_device_in_the_source_is_skipped_with_a_warning(tmp_path):
    """A FIFO in a --source tree hung the recorder for good (opened blocking, twice for proc/self/cgroup);
    /dev/zero as a file was read without end. Now each is one warning line, and the rest is recorded."""
    source = tmp_path / "source"
    shutil.copytree(machine_tree("vm-adjacent-smt"), source)
    for relative in ("proc/cpuinfo", "proc/self/cgroup"):
        (source / relative).unlink()
        os.mkfifo(source / relative)
    (source / "proc/meminfo").unlink(missing_ok=True)
    os.symlink("/dev/zero", source / "proc/meminfo")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "xlaunch.machine.record", str(out), "--source", str(source)],
                            capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"xlaunch-record-machine: warning: {source}/proc/cpuinfo is a FIFO, not a regular file; not recorded",
        f"xlaunch-record-machine: warning: {source}/proc/meminfo is a character device, not a regular file; "
        "not recorded",
        f"xlaunch-record-machine: warning: {source}/proc/self/cgroup is a FIFO, not a regular file; not recorded",
    ]
    assert not (out / "proc/cpuinfo").exists() and len(load_machine(str(out)).cores) == 4


@pytest.mark.parametrize("archive", [False, True])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, archive):
    """A full disk while recording was a traceback that left the half-written folder (or archive) behind."""
    import xlaunch.machine.archive as archive_module
    import xlaunch.machine.record as record

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_copy, copies = record.copy, []

    def copy_until_full(source, out, relative):
        copies.append(relative)
        if len(copies) > 20:
            (Path(out) / "half-written").write_bytes(b"x")
            full()
        return real_copy(source, out, relative)

    monkeypatch.setattr(archive_module, "write_archive", lambda tree, target: (Path(target).write_bytes(b"x"), full()))
    if not archive:
        monkeypatch.setattr(record, "copy", copy_until_full)
    out = tmp_path / "out"
    target = tmp_path / ("out.tar.xz" if archive else "out")
    assert record_main([str(out), "--source", str(machine_tree("vm-adjacent-smt")), *(["--archive"] * archive)]) == 1
    assert capsys.readouterr().err == f"xlaunch-record-machine: error: cannot write {target}: No space left on device\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("out", ["", ".", "..", "/"])
@pytest.mark.parametrize("archive", [False, True])
def test_a_dir_naming_no_new_directory_is_refused(tmp_path, monkeypatch, capsys, out, archive):
    """'' recorded sys/ and proc/ into the current directory (run from / as root, over the live files)
    and '' --archive wrote a hidden .tar.xz there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        record_main([out, "--source", str(machine_tree("vm-no-node")), *(["--archive"] * archive)])
    assert stopped.value.code == 2 and os.listdir(tmp_path) == []
    assert capsys.readouterr().err == f"xlaunch-record-machine: error: DIR: {out!r} names no new directory\n"
