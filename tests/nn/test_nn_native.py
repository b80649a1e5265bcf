"""The compiled kernels: where they are built, when they are used, the fallback when they are
missing, and a child process running every kernel on two threads that exits cleanly."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import require

torch = pytest.importorskip("torch")

from xlaunch.nn import native  # noqa: E402

pytestmark = pytest.mark.torch
REPO = Path(__file__).resolve().parents[2]


def test_the_library_is_keyed_by_its_sources_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(tmp_path / "builds"))
    path = native.library_path()
    assert path.parent == tmp_path / "builds" and path.name.startswith("xlaunch_nn_ops-") and path.suffix == ".so"
    monkeypatch.delenv(native.BUILD_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "xlaunch" / "nn"
    changed = tmp_path / "csrc"
    changed.mkdir()
    for name in (*native.SOURCES, *native.HEADERS):
        (changed / name).write_bytes((native.CSRC / name).read_bytes())
    monkeypatch.setattr(native.LIBRARY, "csrc", changed)
    same = native.build_key()
    (changed / native.SOURCES[0]).write_bytes((changed / native.SOURCES[0]).read_bytes() + b"\n// changed\n")
    assert native.build_key() != same


def test_build_keeps_an_existing_build_and_refuses_a_symlinked_dir(monkeypatch, tmp_path):
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(tmp_path / "link"))
    with pytest.raises(RuntimeError, match="symlink"):
        native.build(echo=lambda line: None)
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(real))
    native.library_path().write_bytes(b"stands for a finished build")
    said = []
    assert native.build(echo=said.append) == native.library_path()          # nothing compiled
    assert said == [f"xlaunch.nn: native kernels already built: {native.library_path()}"]


def test_missing_or_disabled_kernels_mean_the_torch_paths(monkeypatch, tmp_path):
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)                # the suite may run with it set
    monkeypatch.setattr(native.LIBRARY, "loaded", None)
    monkeypatch.setattr(native.LIBRARY, "load_failed", False)
    monkeypatch.setattr(native.LIBRARY, "warned", False)
    monkeypatch.setenv(native.BUILD_DIR_ENV, str(tmp_path))              # nothing built there
    with pytest.warns(RuntimeWarning, match="native kernels not built here"):
        assert native.ops() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                     # said once per process
        assert native.ops() is None
    monkeypatch.setattr(native.LIBRARY, "load_failed", False)
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.ops() is None
    with native.prefer_native(False):
        assert native.ops() is None


CHILD = r"""
import torch, xlaunch.nn as xnn
from xlaunch.nn import native
assert native.ops() is not None
torch.set_num_threads(2)
torch.manual_seed(0)
tables = [torch.nn.EmbeddingBag(500, 16, mode="mean") for _ in range(4)]
merged = xnn.MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables, lr=0.1)
indices = [torch.randint(0, 500, (256 * 8,)) for _ in tables]
offsets = [torch.arange(0, 256 * 8, 8) for _ in tables]
for _ in range(3):
    out = merged(indices, offsets)
    xnn.interaction(torch.randn(256, 16), *out).sum().backward()
image = torch.randn(2, 32, 20, 20, requires_grad=True).contiguous(memory_format=torch.channels_last)
boxes = torch.tensor([[0, 1.0, 1.0, 15.0, 15.0], [1, 2.0, 3.0, 19.0, 12.0]] * 20)
xnn.roi_align(image, boxes, 7, 1.0, 0, True).sum().backward()
print("done", torch.get_num_threads())
"""


@pytest.mark.live
def test_a_child_running_the_kernels_on_two_threads_exits_cleanly():
    require("xlaunch.nn's compiled kernels (python -m xlaunch.nn.native)",
            str(native.library_path()) if native.available() else None)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", native.DISABLE_ENV)}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "done 2\n")


@pytest.mark.live
def test_the_dlrm_example_trains_under_xlaunch_auto_optimize():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", native.DISABLE_ENV)}
    done = subprocess.run([sys.executable, "-m", "xlaunch", "--ninstances", "1", "--ncore_per_instance", "1",
                           "--auto-optimize", str(REPO / "examples" / "dlrm.py"), "--steps", "16", "--tables", "6",
                           "--infer-steps", "2"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    train = next(line for line in done.stdout.splitlines() if "train:" in line)
    first, last = (float(word) for word in train.split("loss ")[1].split(" -> "))
    assert last < first - 0.05, train
    assert "infer:" in done.stdout and "Traceback" not in done.stderr
