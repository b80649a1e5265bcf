"""``python -m xlaunch.nn.native`` as a user meets it: a cache folder that cannot be made, a link into a
folder another user may write, a bad ``XLAUNCH_CPU_ISA``, a ``kill`` in the middle of a build. A stand-in
compiler (``CXX``, a shell script) keeps each test to a second or two: nothing here compiles C++."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from processes import leftovers, running, wait_gone

pytest.importorskip("torch")

from xlaunch import _native_cache  # noqa: E402
from xlaunch.nn import native  # noqa: E402

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[2]
# Writes its -o target; with FAKE_PIDS set, records its pid and that of a child (as g++ starts cc1plus), then waits.
FAKE_CXX = """#!/bin/sh
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
if [ -n "$FAKE_PIDS" ]; then
  sleep 60 & child=$!
  echo "$$ $child" >> "$FAKE_PIDS"
  wait
fi
echo stand-in > "$out"
"""


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """XDG_CACHE_HOME in tmp_path, the stand-in compiler as CXX, no build folder of the suite's."""
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.delenv(native.BUILD_DIR_ENV, raising=False)
    monkeypatch.delenv("XLAUNCH_CPU_ISA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cache_folder_is_never_relative(monkeypatch, tmp_path):
    """A relative XDG_CACHE_HOME is ignored (the XDG rule); HOME unset for a user with no passwd entry left
    ``~/.cache`` unexpanded: the build made a folder named ``~`` in the current directory."""
    monkeypatch.delenv(native.BUILD_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.cache_dir() == tmp_path / "xlaunch" / "nn"
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    assert native.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "xlaunch" / "nn"
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)       # what it returns with no home to find
    assert native.cache_dir() == Path(tempfile.gettempdir()) / f"xlaunch-cache-{os.geteuid()}" / "nn"
    assert _native_cache.cache_root().is_absolute()


def test_a_cache_folder_that_cannot_be_made_is_one_warning(cache, capsys):
    cache.write_text("a file, not a folder")                      # XDG_CACHE_HOME naming a file
    assert native.main([]) == 1
    err = capsys.readouterr().err
    assert err == (f"xlaunch.nn: warning: cannot build into {cache}/xlaunch/nn: Not a directory\n"
                   "xlaunch.nn: the pure-torch paths will be used\n"), err


def test_the_build_never_goes_through_a_link_into_a_folder_others_may_write(cache, capsys):
    """The cache folder a link to a folder inside one that any user may write (not sticky): nothing is
    made there (it was built into, then never loaded)."""
    shared = cache.parent / "shared"
    (shared / "mine").mkdir(parents=True)
    shared.chmod(0o777)
    cache.symlink_to(shared / "mine")
    assert native.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"xlaunch.nn: warning: refusing to build into {cache}/xlaunch/nn: another user could "), err
    assert "777" in err.splitlines()[0]
    assert list((shared / "mine").iterdir()) == []


@pytest.mark.parametrize("argv", [[], ["--path"]])
def test_a_bad_cap_is_one_line_exit_2_and_nothing_built(cache, monkeypatch, capsys, argv):
    monkeypatch.setenv("XLAUNCH_CPU_ISA", "avx9")
    assert native.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("python -m xlaunch.nn.native: error: XLAUNCH_CPU_ISA=avx9: unknown ISA level; "
                                 "valid: baseline, avx2, avx512, avx512_vnni, avx512_bf16, amx\n"), err
    with pytest.raises(ValueError, match="^XLAUNCH_CPU_ISA=avx9: unknown ISA level"):
        native.build(echo=lambda line: None)
    assert not cache.exists()                                     # checked before anything was made


def test_a_killed_build_ends_its_compilers_and_their_children(cache, tmp_path):
    """SIGTERM (``kill``, a set-up script giving up) ended only the build's Python: its compilers (and g++'s
    cc1plus) ran on, orphaned, and its scratch folder stayed for an hour."""
    pids = tmp_path / "pids"
    env = {**os.environ, "FAKE_PIDS": str(pids)}
    build = subprocess.Popen([sys.executable, "-m", "xlaunch.nn.native"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and build.poll() is None:
            started = [int(pid) for line in (pids.read_text() if pids.exists() else "").splitlines()
                       for pid in line.split()]
            if started:
                break
            time.sleep(0.05)
        assert started, build.communicate()
        build.send_signal(signal.SIGTERM)
        out, err = build.communicate(timeout=30)
        assert build.returncode == 128 + signal.SIGTERM and err == "", (build.returncode, err)
        assert wait_gone(started, 5) == []
        assert [p.name for p in (cache / "xlaunch" / "nn").iterdir()] == []      # no scratch left
    finally:
        if build.poll() is None:
            build.kill()
        for pid in running(started):
            os.kill(pid, signal.SIGKILL)


def test_tidying_goes_on_when_another_builds_scratch_goes_meanwhile(monkeypatch, tmp_path):
    """Two builds at once: one's scratch folder, listed by the other's tidying, is removed by its owner before
    it is looked into (that was a FileNotFoundError out of the second build)."""
    (tmp_path / ".build-gone" / "avx2").mkdir(parents=True)
    listed = os.scandir

    def scandir(path):
        if str(path).endswith(".build-gone"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return listed(path)

    monkeypatch.setattr(_native_cache.os, "scandir", scandir)
    assert _native_cache.tidy_cache(tmp_path, "ops", []) == (0, 0)


@pytest.mark.parametrize("value", ["false", "off", "no", "2"])
def test_the_switch_is_0_or_1_and_anything_else_is_one_line(monkeypatch, value):
    """``XLAUNCH_NN_NATIVE=false`` (or off, no) ran the compiled kernels without a word: only "0" turned them off."""
    monkeypatch.setenv(native.DISABLE_ENV, value)
    with pytest.raises(ValueError) as raised:
        native.ops()
    assert str(raised.value) == (f"XLAUNCH_NN_NATIVE={value}: expected 0 (the pure-torch paths) or 1 (the compiled "
                                 "kernels)")
    monkeypatch.setenv(native.DISABLE_ENV, " 0 ")
    assert native.ops() is None
    with native.prefer_native(False):
        monkeypatch.setenv(native.DISABLE_ENV, value)
        assert native.ops() is None                 # an explicit choice in the code wins over the variable


def test_a_full_stdout_never_stops_the_build(cache, tmp_path):
    """Its output to a full disk (or a pipe whose reader left) ended the build at its first line: nothing built,
    exit status 1, "the pure-torch paths will be used"."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "xlaunch.nn.native"], cwd=tmp_path, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", (done.returncode, done.stderr)
    assert sorted(p.name for p in (cache / "xlaunch" / "nn").iterdir()) == sorted(
        native.LIBRARY.file_name(level) for level in native.LEVELS)


def test_a_cxx_that_is_not_there_is_one_warning_not_another_compiler(cache, monkeypatch, capsys):
    """``CXX=clang++`` where there is none (or ``CXX="ccache g++"``) built with g++ instead, said only as
    "with g++" in the progress line."""
    monkeypatch.setenv("PATH", str(cache.parent / "empty"))           # no g++ to fall back on either
    monkeypatch.setenv("CXX", "/nonexistent/clang++")
    assert native.compiler() is None
    assert native.main([]) == 1
    assert capsys.readouterr().err == ("xlaunch.nn: warning: CXX=/nonexistent/clang++: no such compiler (a path, "
                                       "or a command on PATH)\nxlaunch.nn: the pure-torch paths will be used\n")
    assert not cache.exists()


def test_path_says_what_a_load_would_find(cache, monkeypatch, capsys):
    """``--path`` said "built" for a truncated library (which then never loaded) and "not built" for one refused
    (a folder others may write)."""
    monkeypatch.setattr(native.LIBRARY, "refused", {})          # this process's refusals, restored after
    whole = Path(os.path.realpath(sys.executable)).read_bytes()          # a whole ELF file stands for a build
    folder = cache / "xlaunch" / "nn"
    folder.mkdir(parents=True)
    cut, other = native.LEVELS[0], native.LEVELS[1]
    (folder / native.LIBRARY.file_name(cut)).write_bytes(whole[:5000])
    (folder / native.LIBRARY.file_name(other)).write_bytes(whole)
    assert native.main(["--path"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{cut}: {folder / native.LIBRARY.file_name(cut)} (not loadable: truncated (5000 bytes))"
    assert lines[1] == f"{other}: {folder / native.LIBRARY.file_name(other)} (built)"
    folder.chmod(0o777)
    assert native.main(["--path"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"{other}: {folder / native.LIBRARY.file_name(other)} (refused: its folder {folder} is owned "
                        f"by uid {os.geteuid()} with mode 777)"), lines


STOPPED_WHILE_STARTING = """
import os, signal, subprocess, sys

class Starting(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)    # the stop comes while Popen is still starting a compiler

subprocess.Popen = Starting
from xlaunch.nn import native
sys.exit(native.main([]))
"""


def test_a_stop_while_a_compiler_is_being_started_kills_that_compiler_too(cache, tmp_path):
    """A SIGTERM that came inside Popen, after its fork, left that compiler out of the ones to kill: it ran on,
    orphaned (seen once under load as the killed-build test's two survivors). The stop is held until the
    compiler is among them."""
    pids = tmp_path / "pids"
    cxx = os.environ["CXX"]
    build = subprocess.run([sys.executable, "-c", STOPPED_WHILE_STARTING], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "FAKE_PIDS": str(pids)})
    try:
        assert build.returncode == 128 + signal.SIGTERM and build.stderr == "", (build.returncode, build.stderr)
        assert wait_gone(leftovers(cxx), 5) == []
        time.sleep(0.2)
        started = [int(pid) for pid in (pids.read_text() if pids.exists() else "").split()]
        assert running(started) == []
    finally:
        for pid in leftovers(cxx) + [int(p) for p in (pids.read_text() if pids.exists() else "").split()]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
