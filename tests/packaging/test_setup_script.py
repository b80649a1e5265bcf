"""``scripts/setup.sh`` as a user runs it, with stand-ins for what would take minutes: a venv whose
``python`` fakes pip, and a compiler (``CXX``) that only waits. Its ``PATH`` has no ``apt-get``: a
missing Debian package is only a warning here, never an install."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processes import running, wait_gone

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup.sh"
# The venv's python: pip succeeds at once, except for torchao, which fails once the kernels' compilers run.
FAKE_VENV_PYTHON = """#!/bin/bash
[ "$2" = pip ] && echo "$*" >> "$FAKE_ARGS"
[ -n "$FAKE_FAIL" ] && [[ "$*" == *"$FAKE_FAIL"* ]] && { echo "ERROR: no $FAKE_FAIL here"; exit 1; }
case "$*" in
  *"-m pip install"*torchao*)
    for _ in $(seq 600); do [ -s "$FAKE_PIDS" ] && break; sleep 0.05; done
    echo "ERROR: no torchao here"; exit 1;;
  *"-m pip"*|*"-m compileall"*) exit 0;;
  *sysconfig*) echo "$(dirname "$0")/../lib"; exit 0;;
esac
exec {python} "$@"
"""
FAKE_CXX = """#!/bin/sh
sleep 60 & child=$!
echo "$$ $child" >> "$FAKE_PIDS"
wait
"""


def _path_without_apt(tmp_path: Path) -> str:
    """PATH's commands, apt-get and apt left out (symlinks in one folder)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for directory in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name not in ("apt-get", "apt") and not (folder / name).exists():
                (folder / name).symlink_to(os.path.join(directory, name))
    return str(folder)


def _setup(env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=timeout)


def _version_stub(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("python, why", [
    ("/nonexistent/python3", "not a Python interpreter that runs here"),
    ("stub:3.9", "is Python 3.9; torch 2.13 needs Python 3.10 or later"),
    ("venv:3.99", "was made with Python 3.99: remove"),
])
def test_a_python_that_cannot_be_used_is_one_line_before_anything_is_done(tmp_path, python, why):
    """An existing venv of another version was kept in silence (``PYTHON=python3.12`` set up 3.11 again)."""
    venv = tmp_path / "venv"
    if python.startswith("stub:"):
        python = str(_version_stub(tmp_path / "py" / "python", python[5:]))
    elif python.startswith("venv:"):
        _version_stub(venv / "bin" / "python", python[5:])
        python = sys.executable
    env = {**os.environ, "PYTHON": python, "VENV": str(venv), "PATH": _path_without_apt(tmp_path)}
    done = _setup(env)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"setup: PYTHON={python}")
    assert why in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bin", *(["venv"] if venv.exists() else []),
                                                                *(["py"] if (tmp_path / "py").exists() else [])])


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_VENV_PYTHON.replace("{python}", sys.executable))
    (venv / "bin" / "python").chmod(0o755)
    return venv


def test_torch_is_asked_for_as_its_cpu_build(tmp_path):
    """``torch==2.13.0`` is the registry's CUDA build (cuda-toolkit: gigabytes); it was the CPU build here only
    where a local +cpu wheel matched (Python 3.11), and PYTHON=python3.12 pulled the CUDA one."""
    args = tmp_path / "args"
    env = {**os.environ, "VENV": str(_fake_venv(tmp_path)), "FAKE_ARGS": str(args), "FAKE_FAIL": "torch==",
           "PATH": _path_without_apt(tmp_path)}
    env.pop("TORCH_INDEX_URL", None)
    done = _setup(env)
    assert done.returncode == 1 and "ERROR: no torch== here" in done.stderr, (done.stdout, done.stderr)
    torch_step = args.read_text().splitlines()[-1].split()
    assert "torch==2.13.0+cpu" in torch_step, torch_step
    index = torch_step.index("--extra-index-url")
    assert torch_step[index + 1] == "https://download.pytorch.org/whl/cpu", torch_step
    first = [line.split() for line in args.read_text().splitlines() if "torch==2.13.0+cpu" in line]
    assert len(first) == 2 and "--extra-index-url" not in first[0], first   # pip's own indexes were asked first


def test_the_cpu_index_is_not_asked_when_pips_own_indexes_hold_the_cpu_build(tmp_path):
    """Where pip's configured indexes hold torch 2.13.0+cpu (a wheel cache, a mirror), the unreachable CPU index
    was asked all the same: 55 retries, 84 s of set-up. It is asked only when they have none, or when named."""
    args, cxx = tmp_path / "args", tmp_path / "no-cxx"
    cxx.write_text("#!/bin/sh\nexit 1\n")      # the kernel build started alongside compiles nothing
    cxx.chmod(0o755)
    env = {**os.environ, "VENV": str(_fake_venv(tmp_path)), "FAKE_ARGS": str(args), "FAKE_FAIL": "torchao==",
           "PATH": _path_without_apt(tmp_path), "CXX": str(cxx)}
    env.pop("TORCH_INDEX_URL", None)
    done = _setup(env)
    assert done.returncode == 1 and "ERROR: no torchao== here" in done.stderr, (done.stdout, done.stderr)
    torch_steps = [line.split() for line in args.read_text().splitlines() if "torch==2.13.0+cpu" in line]
    assert len(torch_steps) == 1 and "--extra-index-url" not in torch_steps[0], torch_steps
    args.unlink()
    done = _setup({**env, "TORCH_INDEX_URL": "file:///mirror/whl/cpu"})
    torch_steps = [line.split() for line in args.read_text().splitlines() if "torch==2.13.0+cpu" in line]
    assert len(torch_steps) == 1 and "file:///mirror/whl/cpu" in torch_steps[0], torch_steps


@pytest.mark.live
def test_a_failed_install_leaves_no_kernel_build_running(tmp_path):
    """pip failing while the kernels compile alongside: the trap killed the build's subshell, and the build
    and its compilers ran on after set-up had exited."""
    pytest.importorskip("torch")
    venv, pids = _fake_venv(tmp_path), tmp_path / "pids"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLAUNCH_", "PYTHON"))}
    env.update(VENV=str(venv), CXX=str(cxx), FAKE_PIDS=str(pids), XDG_CACHE_HOME=str(tmp_path / "cache"),
               FAKE_ARGS=str(tmp_path / "args"), PATH=_path_without_apt(tmp_path))
    started: list[int] = []
    try:
        done = _setup(env, timeout=120)
        started = [int(pid) for pid in pids.read_text().split()] if pids.exists() else []
        assert done.returncode == 1 and "ERROR: no torchao here" in done.stderr, (done.stdout, done.stderr)
        assert started, (done.stdout, done.stderr)
        assert wait_gone(started, 10) == []
        assert [p.name for p in (tmp_path / "cache" / "xlaunch" / "nn").iterdir()] == []   # no scratch left
    finally:
        for pid in running(started):
            os.kill(pid, signal.SIGKILL)
