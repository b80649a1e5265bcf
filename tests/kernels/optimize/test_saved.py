"""save/load of what optimize(backend=...) keeps: the ONNX model and the OpenVINO IR, loaded in a
fresh process without the model's class, give the same outputs; a truncated file, a planted symlink,
a missing engine and a route that cannot be saved are one clear error each."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optimize import load_optimized, save_optimized, SavedModelError  # noqa: E402
from xlaunch.kernels.optimize.pipeline import optimize  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[3]
ENGINES = [name for name in ("onnxruntime", "openvino") if importlib.util.find_spec(name) is not None]


class Net(nn.Module):
    """Two inputs (one batched), a plain value, outputs in a dict with a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: float) -> dict:
        out = self.net(x) * scale + bias
        return {"logits": out, "pair": (out.sum(-1), x.mean(-1))}


def built(backend: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = Net().eval()
    args = (torch.randn(6, 12), torch.randn(5), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optimize(model, sample_input=args, backend=backend, cache=False, progress=False, time_budget=5), args


LOADER = r"""
import json, sys
import torch
from torch.utils import _pytree as pytree
from xlaunch.kernels.optimize import load_optimized
torch.manual_seed(1)
results = {}
for path in sys.argv[1:]:
    model = load_optimized(path)
    assert "Net" not in sys.modules and not hasattr(sys.modules["__main__"], "Net")
    out = {}
    for batch in (6, 1, 9):
        x = torch.arange(batch * 12, dtype=torch.float32).reshape(batch, 12).sin()
        flat, spec = pytree.tree_flatten(model(x, torch.linspace(-1, 1, 5), 0.5))
        out[batch] = {"spec": str(spec), "values": [t.tolist() for t in flat]}
    results[path] = {"route": model.route, "outputs": out}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def engines() -> dict:
    """One build per engine installed here, shared by the tests (a build takes seconds)."""
    return {backend: built(backend) for backend in ENGINES}


@pytest.mark.skipif(not ENGINES, reason="neither onnxruntime nor openvino is installed")
def test_save_then_load_in_a_fresh_process_gives_the_same_outputs(engines: dict, tmp_path: Path) -> None:
    from torch.utils import _pytree as pytree

    expected, paths = {}, []
    for backend in ENGINES:
        fast, args = engines[backend]
        assert fast.report.backend == backend, str(fast.report)
        path = tmp_path / f"{backend}.xlaunch"
        assert fast.save(str(path)) == str(path)
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["route"] == backend and manifest["dtype"] == "float32"
        assert manifest["inputs"][0] == {"tensor": True, "dtype": "float32", "shape": [12], "batched": True}
        assert manifest["inputs"][2] == {"tensor": False, "type": "float", "repr": "0.5"}
        assert manifest["versions"]["torch"] == torch.__version__.split("+")[0] or manifest["versions"]["torch"]
        with torch.no_grad():
            expected[str(path)] = {}
            for batch in (6, 1, 9):
                x = torch.arange(batch * 12, dtype=torch.float32).reshape(batch, 12).sin()
                flat, spec = pytree.tree_flatten(fast(x, torch.linspace(-1, 1, 5), 0.5))
                expected[str(path)][str(batch)] = (str(spec), flat)
        paths.append(str(path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", LOADER, *paths], capture_output=True, text=True, timeout=240,
                          cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    for path in paths:
        assert loaded[path]["route"] in ENGINES
        for batch, (spec, flat) in expected[path].items():
            got = loaded[path]["outputs"][batch]
            assert got["spec"] == spec
            for want, values in zip(flat, got["values"]):
                have = torch.tensor(values, dtype=want.dtype)
                assert torch.allclose(have, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (path, batch)


@pytest.fixture(scope="module")
def saved_onnx(engines: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple, nn.Module]:
    if "onnxruntime" not in ENGINES:
        pytest.skip("onnxruntime is not installed")
    fast, args = engines["onnxruntime"]
    path = tmp_path_factory.mktemp("saved") / "model.xlaunch"
    save_optimized(fast, str(path))
    return path, args, fast


def copy_of(path: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "copy.xlaunch"
    shutil.copytree(path, target)
    return target


def test_a_truncated_file_is_one_clear_error(saved_onnx: tuple, tmp_path: Path) -> None:
    path = copy_of(saved_onnx[0], tmp_path)
    data = (path / "model.onnx").read_bytes()
    (path / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(SavedModelError, match=r"model.onnx is truncated or changed") as caught:
        load_optimized(str(path))
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    (path / "manifest.json").write_text('{"format": "xlaunch.optimize/1", "files"')   # a cut manifest
    with pytest.raises(SavedModelError, match="manifest.json is not valid JSON"):
        load_optimized(str(path))


def test_a_planted_symlink_is_never_followed(saved_onnx: tuple, tmp_path: Path) -> None:
    path = copy_of(saved_onnx[0], tmp_path)
    real = tmp_path / "elsewhere.onnx"
    (path / "model.onnx").rename(real)
    os.symlink(real, path / "model.onnx")          # same bytes, but through a link
    with pytest.raises(SavedModelError, match="model.onnx: cannot open"):
        load_optimized(str(path))
    linked = tmp_path / "linked.xlaunch"
    os.symlink(saved_onnx[0], linked)              # the saved directory itself through a link
    with pytest.raises(SavedModelError, match="symlinks are not followed"):
        load_optimized(str(linked))
    fast = saved_onnx[2]
    victim = tmp_path / "victim"
    victim.mkdir()
    trap = tmp_path / "trap.xlaunch"
    os.symlink(victim, trap)                       # saving to a planted link writes nothing through it
    with pytest.raises(SavedModelError, match="exists"):
        fast.save(str(trap))
    assert list(victim.iterdir()) == [] and os.path.islink(trap)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left


def test_an_onnx_model_reading_external_data_is_refused(saved_onnx: tuple, tmp_path: Path) -> None:
    """A hostile model.onnx (manifest hashes updated to match) whose weights point at another file."""
    import hashlib

    onnx = pytest.importorskip("onnx")
    from onnx import external_data_helper

    path = copy_of(saved_onnx[0], tmp_path)
    model = onnx.load_model_from_string((path / "model.onnx").read_bytes())
    external_data_helper.convert_model_to_external_data(model, all_tensors_to_one_file=True, location="../secret",
                                                        size_threshold=0)
    data = model.SerializeToString()
    (path / "model.onnx").write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SavedModelError, match=r"reads tensor .* from another file \(external data\): refused"):
        load_optimized(str(path))


def test_a_missing_engine_names_the_extra(saved_onnx: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)   # as if not installed
    with pytest.raises(SavedModelError, match=r'onnxruntime is not installed: pip install "xlaunch\[onnxruntime\]"'):
        load_optimized(str(saved_onnx[0]))


def test_loaded_model_refuses_other_inputs_and_torch_routes_refuse_to_save(saved_onnx: tuple, tmp_path: Path) -> None:
    model = load_optimized(str(saved_onnx[0]))
    x, bias, _ = saved_onnx[1]
    with pytest.raises(ValueError, match=r"argument 0 must be a float32 tensor of shape \['N', 12\]"):
        model(torch.randn(2, 13), bias, 0.5)
    with pytest.raises(ValueError, match="argument 2 must be 0.5"):
        model(x, bias, 2.0)
    eager, _ = built("eager")
    with pytest.raises(SavedModelError, match="^save: the route kept is eager; .*state_dict") as caught:
        eager.save(str(tmp_path / "eager.xlaunch"))
    assert "\n" not in str(caught.value) and not (tmp_path / "eager.xlaunch").exists()
    with pytest.raises(SavedModelError, match="not a model returned by optimize"):
        save_optimized(nn.Linear(2, 2), str(tmp_path / "plain.xlaunch"))
