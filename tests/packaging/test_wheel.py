"""The wheel a user installs: built from this tree, installed into a fresh venv WITHOUT torch.

The launcher and the recorder work there; every torch-needing entry point raises one ImportError
that names ``pip install "xlaunch[torch]"``. Needs the package registry for click, psutil and
py-cpuinfo: skipped only when pip cannot reach it. The wheel carries the C++ kernels prebuilt at
every ISA level (copied from the cache ``make setup`` filled); installed beside this torch, with
no compiler on PATH, they load and run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HINT = 'pip install "xlaunch[torch]"'
OFFLINE = ("Could not find a version", "No matching distribution", "NewConnectionError",
           "Failed to establish a new connection", "Temporary failure in name resolution",
           "Network is unreachable", "ConnectTimeout", "ProxyError")

pytestmark = pytest.mark.slow


def run(argv: list, *, cwd: Path, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A wheel freshly built from a copy of this tree (its kernels copied from the build cache)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"                        # a copy: building leaves build/ and egg-info behind
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "xlaunch", source / "xlaunch", ignore=shutil.ignore_patterns("__pycache__"))
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                 "-w", work / "dist", source], cwd=work, timeout=1200)
    assert built.returncode == 0, built.stderr
    (wheel,) = (work / "dist").glob("xlaunch-*.whl")
    return wheel


def clean_env(work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLAUNCH_FSROOT", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(work / "cache")
    return env


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> tuple[Path, dict, str | None]:
    """(venv, env without PYTHONPATH, why offline or None): one venv for the module, the wheel installed
    into it without torch. Offline (pip cannot reach the registry for click, psutil and py-cpuinfo), the
    wheel goes in without its dependencies: the prebuilt-kernel test still runs (this torch's
    site-packages brings them), the torch-free ones skip."""
    work = tmp_path_factory.mktemp("venv")
    venv = work / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
    assert made.returncode == 0, made.stderr
    env = clean_env(work)
    pip = [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q"]
    install = run([*pip, built], cwd=work, env=env)
    offline = None
    if install.returncode != 0 and any(word in install.stderr for word in OFFLINE):
        offline = install.stderr.strip().splitlines()[-1]
        install = run([*pip, "--no-deps", built], cwd=work, env=env)
    assert install.returncode == 0, install.stderr
    return venv, env, offline


@pytest.fixture(scope="module")
def installed(built, venv) -> tuple[Path, Path, dict]:
    """(wheel, venv, env without PYTHONPATH) with xlaunch installed from the wheel, without torch."""
    venv, env, offline = venv
    if offline:
        pytest.skip(f"pip cannot reach the package registry: {offline}")
    return built, venv, env


def test_the_wheel_holds_the_data_files_and_both_commands(installed):
    wheel, _, _ = installed
    # any Python: the kernels link torch's libraries, not Python's (it was cp311-cp311: 3.12's pip refused it)
    assert wheel.name.split("-")[2:4] == ["py3", "none"], wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(meta).decode()
        entry_points = archive.read(meta.replace("METADATA", "entry_points.txt")).decode()
    for path in ("xlaunch/py.typed", "xlaunch/configs/throughput.toml", "xlaunch/kernels/inject/site/sitecustomize.py",
                 "xlaunch/machine/record.py", "xlaunch/nn/csrc/bag_forward.cpp", "xlaunch/nn/csrc/roi_align.cpp",
                 "xlaunch/_csrc/isa_level.cpp",
                 "xlaunch/nn/csrc/common.h"):
        assert path in names, path
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "Requires-Dist: torch>=2.13; extra == \"torch\"" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "xlaunch-record-machine = xlaunch.machine.record:main" in entry_points


def test_without_torch_the_launcher_and_recorder_work(installed, tmp_path):
    _, venv, env = installed
    bin_dir = venv / "bin"
    assert run([bin_dir / "python", "-c", "import torch"], cwd=tmp_path, env=env).returncode != 0
    recorded = run([bin_dir / "xlaunch-record-machine", tmp_path / "here", "--archive"], cwd=tmp_path, env=env)
    assert recorded.returncode == 0, recorded.stderr
    archive = tmp_path / "here.tar.xz"
    live = run([bin_dir / "xlaunch", "--dry-run", "--json", "--no-python", "true"], cwd=tmp_path, env=env)
    assert live.returncode == 0, live.stderr
    from_archive = run([bin_dir / "xlaunch", "--dry-run", "--json", "--no-python", "true"], cwd=tmp_path,
                       env={**env, "XLAUNCH_FSROOT": str(archive)})
    assert from_archive.returncode == 0, from_archive.stderr
    cpus = [[i["cpus"] for i in json.loads(r.stdout)["instances"]] for r in (live, from_archive)]
    assert cpus[0] == cpus[1] and cpus[0]


@pytest.mark.parametrize("expression, what", [
    ("xlaunch.optimize", "xlaunch.optimize"),
    ("xlaunch.MultiStreamModule", "xlaunch.MultiStreamModule"),
    ("xlaunch.kernels.FusedAdamW", "xlaunch.kernels.FusedAdamW"),
    ("xlaunch.runtime_ext.MultiStreamModule", "xlaunch.runtime_ext.MultiStreamModule"),
])
def test_without_torch_each_entry_point_says_how_to_get_it(installed, tmp_path, expression, what):
    _, venv, env = installed
    code = f"import xlaunch, xlaunch.kernels, xlaunch.runtime_ext\n{expression}\n"
    result = run([venv / "bin" / "python", "-c", code], cwd=tmp_path, env=env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"ImportError: {what} needs PyTorch, which is not installed here: {HINT}", result.stderr
    assert "No module named 'torch'" not in result.stderr      # one message, no chained traceback


def test_without_torch_pools_work_and_pinning_says_what_is_missing(installed, tmp_path):
    _, venv, env = installed
    code = ("import os, xlaunch\n"
            "pool = xlaunch.CPUPool()\n"
            "assert set(pool.cpus) <= os.sched_getaffinity(0), pool.cpus\n"
            "try:\n"
            "    with xlaunch.pin(pool):\n"
            "        pass\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    result = run([venv / "bin" / "python", "-c", code], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OpenMPNotFoundError") and HINT in result.stdout, result.stdout


def test_the_wheel_carries_the_kernels_of_every_level_for_this_torch(built):
    pytest.importorskip("torch")
    from xlaunch.llm import native as llm_native
    from xlaunch.nn import native as nn_native

    wheel = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for native in (nn_native, llm_native):
        for level in native.LEVELS:      # every level, also those this CPU cannot execute: they compile here
            path = f"{native.__package__.replace('.', '/')}/prebuilt/{native.LIBRARY.file_name(level)}"
            assert path in names, path


KERNELS = r"""
import shutil, sys
assert "torch" not in sys.modules and shutil.which("g++") is None and shutil.which("c++") is None
sys.path.append(sys.argv[1])       # this torch beside the venv, as a .pth there would add it (last)
import torch
from xlaunch.nn import native as nn_native
from xlaunch.llm import native as llm_native, fused
assert sys.modules["xlaunch"].__file__.startswith(sys.prefix), sys.modules["xlaunch"].__file__   # the wheel's
for native in (nn_native, llm_native):
    assert "/prebuilt/" in str(native.LIBRARY.find(native.level())), native.LIBRARY.find(native.level())
    assert native.ops().compiled_isa() == native.level(), native.level()
x, w = torch.randn(3, 64), torch.rand(64) + 0.5
expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
with llm_native.prefer_native(True):
    assert torch.allclose(fused.rms_norm(x, w, 1e-6), expected, rtol=1e-5, atol=1e-5)
print(nn_native.level(), llm_native.level())
"""


def test_the_installed_wheel_runs_its_prebuilt_kernels_without_a_compiler(venv, tmp_path):
    """The module's venv, this torch added to its path (its site-packages brings click, psutil and
    py-cpuinfo when the registry could not), no g++ on PATH. One venv for the module: a second venv
    and install would prove nothing more (the torch-free tests run in a child without this path)."""
    torch = pytest.importorskip("torch")
    from xlaunch.llm import native as llm_native

    venv, env, _ = venv
    no_compiler = {k: v for k, v in env.items() if not k.endswith(("_BUILD_DIR", "_NATIVE"))}
    no_compiler.update(PATH=str(venv / "bin"), CXX="")
    torch_site = str(Path(torch.__file__).resolve().parents[1])
    done = run([venv / "bin" / "python", "-c", KERNELS, torch_site], cwd=tmp_path, env=no_compiler)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1] == llm_native.level()
