"""xlaunch.userfiles and the TOML depth check: files a user hands us are read bounded, files we
write never go through a symlink nor replace a special file. (FIFOs, which could hang a
regression, are tested through the CLI in subprocesses: tests/launcher/cli/test_hostile_input.py.)"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from xlaunch.configs import MAX_NESTING, nesting_depth, parse_toml
from xlaunch.userfiles import (UserFileError, check_writable_dir, read_user_file, read_user_text, write_all,
                               write_atomically)


def test_reads_a_regular_file_and_a_symlink_to_one(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_bytes(b"x = 1\n")
    os.symlink(tmp_path / "a.toml", tmp_path / "link.toml")
    assert read_user_file(str(tmp_path / "a.toml")) == b"x = 1\n"
    assert read_user_text(str(tmp_path / "link.toml")) == "x = 1\n"


@pytest.mark.parametrize("path, words", [("/dev/zero", "a character device, not a regular file"),
                                         ("/", "a directory, not a regular file"),
                                         ("/nonexistent/x.toml", "cannot read /nonexistent/x.toml: No such file")])
def test_refuses_what_is_not_a_regular_file(path: str, words: str) -> None:
    with pytest.raises(UserFileError, match=words):
        read_user_file(path)


def test_a_byte_order_mark_is_dropped_and_the_files_read(tmp_path: Path) -> None:
    """A config saved by Notepad starts with EF BB BF: tomllib said "Invalid statement (at line 1, column 1)"."""
    from xlaunch.configs import load_config

    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbfninstances = 2\n")
    assert read_user_text(str(tmp_path / "bom.toml")) == "ninstances = 2\n"
    assert load_config(str(tmp_path / "bom.toml"))[0] == {"ninstances": 2}


def test_caps_the_size_also_when_the_file_system_reports_none(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 2000)
    with pytest.raises(UserFileError, match="is 2000 bytes; files over 1000 bytes are not read"):
        read_user_file(str(tmp_path / "big"), limit=1000)
    assert os.stat("/proc/self/maps").st_size == 0          # procfs says 0 and holds kilobytes
    with pytest.raises(UserFileError, match="holds more than 100 bytes"):
        read_user_file("/proc/self/maps", limit=100)
    (tmp_path / "latin1").write_bytes(b"caf\xe9\n")
    with pytest.raises(UserFileError, match="is not UTF-8 text"):
        read_user_text(str(tmp_path / "latin1"))


def test_write_replaces_a_symlink_and_never_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "out.json")
    write_atomically(str(tmp_path / "out.json"), b"{}\n")
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "out.json").is_symlink() and (tmp_path / "out.json").read_bytes() == b"{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim"]       # no temporary left


def test_write_refuses_special_files_and_leaves_them_as_they_were(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name, kind in (("fifo", "a FIFO"), ("dir", "a directory")):
        with pytest.raises(UserFileError, match=f"is {kind}, not a regular file"):
            write_atomically(str(tmp_path / name), b"data")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and (tmp_path / "dir").is_dir()
    try:                   # a private /dev/null: a regression must not replace the real one
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs root")
    with pytest.raises(UserFileError, match="a character device, not a regular file"):
        write_atomically(str(tmp_path / "null"), b"data")
    assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)
    with pytest.raises(UserFileError, match="empty path"):
        write_atomically("", b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fifo", "null"]


def test_a_failed_write_removes_its_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_atomically(str(tmp_path / "out"), "text, not bytes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_writable_directory_is_tried_not_assumed(tmp_path: Path) -> None:
    assert check_writable_dir(str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []
    assert check_writable_dir("/proc") is not None          # os.access says yes to root here
    assert check_writable_dir(str(tmp_path / "missing")) == "No such file or directory"


@pytest.mark.parametrize("text, depth", [
    ("a = 1\n", 0),
    ("[t]\nb = [[1, 2], [3]]\n", 2),
    ("[[servers]]\nx = {y = {z = [1]}}\n", 3),
    ('a = "[[[[[[[[[[ not nested ]"\n', 0),
    ("a = '[[[[[[[[['  # [[[[[[[[[[\n", 0),
    ('a = """\n[[[[\\"""[[[["""\nb = [1]\n', 1),
    ("a = '''[[[[\n[[[[''' \nb = [[2]]\n", 2),
    ('"k[[[" = [1]\n', 1),
])
def test_nesting_depth_counts_brackets_outside_strings_and_comments(text: str, depth: int) -> None:
    assert nesting_depth(text) == depth
    parse_toml(text)                                         # and they are valid TOML


def test_nesting_is_capped_before_the_toml_reader_recurses() -> None:
    parse_toml("a = " + "[" * MAX_NESTING + "]" * MAX_NESTING + "\n")
    with pytest.raises(ValueError, match=f"nested {MAX_NESTING + 1} deep"):
        parse_toml("a = " + "[" * 5000 + "\n")
    with pytest.raises(ValueError, match="nested"):
        parse_toml("a = " + "{b = " * 40 + "1" + "}" * 40 + "\n")


def test_write_all_follows_a_short_write_with_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 41
    real_write, sizes = os.write, []
    monkeypatch.setattr(os, "write", lambda fd, view: sizes.append(real_write(fd, bytes(view[:1000]))) or sizes[-1])
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert (tmp_path / "out").read_bytes() == data and len(sizes) == 11 and sizes[-1] == len(data) - 10000


def test_read_head_reads_the_first_bytes_of_a_regular_file_of_any_size(tmp_path) -> None:
    from xlaunch.userfiles import DEFAULT_LIMIT, read_head

    big = tmp_path / "big.sh"
    big.write_bytes(b"#!/bin/sh\n" + b"x" * (DEFAULT_LIMIT + 10))
    assert read_head(str(big), 16) == b"#!/bin/sh\nxxxxxx"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                       # no writer: an open without O_NONBLOCK would block for ever
    assert read_head(str(fifo), 16) == b"" and read_head(str(tmp_path), 16) == b""
    assert read_head(str(tmp_path / "missing"), 16) == b""
