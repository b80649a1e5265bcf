"""Saved INT8 models: the manifest, damaged and hostile files, and a save that would write
through a symlink, each one clear error.

One tiny MLP, quantized once per route for the session (the fixture,
``quantize_models.saved_variants``, which test_quantize.py reads too), and the bf16 float variant
``auto`` may keep. Each of these routes saves and loads in a fresh process (no
model class there), with a missing engine one clear ImportError, in test_quantize.py's
``test_save_then_load_in_a_fresh_process``: one child process loads them with the compiled models
of that file (each process imports torch and torchao: seconds)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import sys
import warnings
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from quantize_models import saved_variants, tiny_mlp  # noqa: E402

from xlaunch.kernels.quantize import engine_saved, saved  # noqa: E402
from xlaunch.kernels.quantize.api import load_quantized, quantize  # noqa: E402

pytestmark = pytest.mark.torch
ENGINE_ROUTES = tuple(engine_saved.ENGINES)


@pytest.fixture(scope="module")
def quantized() -> dict:
    """route -> (quantized model, input) or the reason it cannot be built here."""
    return saved_variants()


def _manifest(path: Path) -> dict:
    with zipfile.ZipFile(path) as archive:
        entry = next(n for n in archive.namelist() if n.endswith(saved.META_FILE))
        return json.loads(archive.read(entry))


def test_the_manifest_holds_signature_report_and_versions(tmp_path: Path, quantized: dict) -> None:
    found = [route for route in ("weight_only", *ENGINE_ROUTES) if not isinstance(quantized[route], str)]
    if not found:
        pytest.skip("neither weight_only nor an engine route can be built here")
    for route in found:
        q, x = quantized[route]
        q.save(str(tmp_path / route))
        meta = _manifest(tmp_path / route)
        engine = engine_saved.ENGINES.get(route, "torch")
        assert (meta["mode"], meta["engine"], meta["report"]["mode"]) == (route, engine, route)
        assert meta["inputs"] == [{"dtype": "float32", "shape": [None, *x.shape[1:]]}]
        assert meta["versions"]["torch"] == metadata.version("torch")   # a CUDA wheel's __version__ adds +cu130
        if engine != "torch":
            assert meta["format"] == saved.ENGINE_FORMAT_VERSION and meta["output_count"] == 1
            assert sorted(meta["files"]) == sorted(engine_saved.FILES[engine])
            assert meta["versions"][engine] not in ("-", None)


def _rewrite(source: Path, target: Path, change) -> Path:
    """``source``'s entries, passed through ``change(info, data) -> [(info, data), ...]``, with the
    manifest's sizes and hashes brought up to date (so only the change itself is wrong)."""
    with zipfile.ZipFile(source) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    out = []
    for info, data in entries:
        out.extend(change(info, data))
    meta = json.loads(next(d for i, d in out if i.filename == saved.META_FILE))
    for info, data in out:
        if info.filename in meta.get("files", {}):
            meta["files"][info.filename] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with zipfile.ZipFile(target, "w") as archive:
        for info, data in out:
            archive.writestr(info, json.dumps(meta) if info.filename == saved.META_FILE else data)
    return target


def _engine_file(tmp_path: Path, quantized: dict) -> tuple[Path, str, torch.Tensor]:
    for route in ENGINE_ROUTES:
        if not isinstance(quantized[route], str):
            q, x = quantized[route]
            q.save(str(tmp_path / "good.xq"))
            return tmp_path / "good.xq", route, x
    pytest.skip("no engine INT8 route can be built here: " + "; ".join(quantized[r] for r in ENGINE_ROUTES))


def test_damaged_or_hostile_files_are_one_clear_error(tmp_path: Path, quantized: dict) -> None:
    good, route, x = _engine_file(tmp_path, quantized)
    data = good.read_bytes()
    model_file = engine_saved.FILES[engine_saved.ENGINES[route]][0]
    loaded = load_quantized(str(good))   # the control; a call it does not serve is one error
    torch.testing.assert_close(loaded(x), quantized[route][0](x), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match=rf"good.xq: takes \(float32\[N,{x.shape[1]}\]\); argument 0 is float64"):
        loaded(x.double())

    def symlink(info, content):
        if info.filename == model_file:   # the model entry replaced by a link to a file of this machine
            link = zipfile.ZipInfo(model_file)
            link.external_attr = (stat.S_IFLNK | 0o777) << 16
            return [(link, b"/etc/passwd")]
        return [(info, content)]

    def engine(name):
        def change(info, content):
            if info.filename == saved.META_FILE:
                return [(info, json.dumps({**json.loads(content), "engine": name}).encode())]
            return [(info, content)]
        return change

    def compressed(info, content):
        if info.filename == model_file:
            info.compress_type = zipfile.ZIP_DEFLATED
        return [(info, content)]

    (tmp_path / "truncated.xq").write_bytes(data[: len(data) // 2])
    (tmp_path / "tail_cut.xq").write_bytes(data[:-10])
    flipped, info = bytearray(data), zipfile.ZipFile(good).getinfo(model_file)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    flipped[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0xFF   # in the model's bytes
    (tmp_path / "flipped.xq").write_bytes(bytes(flipped))
    cases = {
        "truncated.xq": "truncated.xq is corrupt or not a saved model",
        "tail_cut.xq": "tail_cut.xq is corrupt or not a saved model",
        "flipped.xq": "flipped.xq is corrupt: .*(does not match|Bad CRC)",
        _rewrite(good, tmp_path / "link.xq", symlink).name:
            f"link.xq is refused: entry '{model_file}' is a symbolic link",
        _rewrite(good, tmp_path / "tensorrt.xq", engine("tensorrt")).name:
            "tensorrt.xq names engine 'tensorrt', which this xlaunch does not run",
        _rewrite(good, tmp_path / "other.xq", engine("torch")).name: "other.xq is corrupt.*no valid mode",
        _rewrite(good, tmp_path / "extra.xq", lambda i, d: [(i, d), (zipfile.ZipInfo("../escape"), b"x")]
                 if i.filename == model_file else [(i, d)]).name: "extra.xq is refused: unexpected entry '../escape'",
        _rewrite(good, tmp_path / "deflated.xq", compressed).name: "deflated.xq is corrupt: .* is compressed",
    }
    if route == "onnxruntime_static":
        import onnx

        def external(info, content):
            if info.filename != model_file:
                return [(info, content)]
            model = onnx.ModelProto.FromString(content)
            tensor = model.graph.initializer[0]
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            entry = tensor.external_data.add()
            entry.key, entry.value = "location", "../../../../etc/hostname"
            return [(info, model.SerializeToString())]
        cases[_rewrite(good, tmp_path / "external.xq", external).name] = \
            "external.xq is refused: its ONNX model reads tensor .* from an external file"
    before = sorted(os.listdir(tmp_path))
    for name, match in cases.items():
        with pytest.raises(ValueError, match=match) as raised:
            load_quantized(str(tmp_path / name))
        assert "\n" not in str(raised.value) and raised.value.__cause__ is None, name
    assert sorted(os.listdir(tmp_path)) == before   # nothing extracted or written


def test_save_never_writes_through_a_symlink(tmp_path: Path, quantized: dict) -> None:
    route = next((r for r in ("weight_only", *ENGINE_ROUTES) if not isinstance(quantized[r], str)), None)
    if route is None:
        pytest.skip("neither weight_only nor an engine route can be built here")
    q, x = quantized[route]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "link.xq").symlink_to(victim)
    with pytest.raises(ValueError, match="link.xq is a symbolic link; save does not write through one"):
        q.save(str(tmp_path / "link.xq"))
    assert victim.read_text() == "keep me"
    os.mkfifo(tmp_path / "fifo.xq")
    with pytest.raises(ValueError, match="fifo.xq exists and is not a regular file"):
        q.save(str(tmp_path / "fifo.xq"))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        q.save(str(tmp_path / "absent" / "model.xq"))
    target = tmp_path / "model.xq"
    target.write_bytes(b"an older file")
    q.save(str(target))   # replaced whole; no temporary file left beside it
    assert sorted(os.listdir(tmp_path)) == ["fifo.xq", "link.xq", "model.xq", "victim.txt"]
    assert stat.S_IMODE(target.stat().st_mode) & 0o600 == 0o600
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(str(target))(x), q(x), rtol=1e-5, atol=0)


def test_the_signature_round_trips_without_the_model_classes() -> None:
    """What a loaded engine model takes and returns, from the manifest's JSON alone: a named
    tuple comes back as a tuple, a dict as a dict, a plain argument must keep its exported value."""
    from collections import namedtuple

    from xlaunch.kernels.optimize.engines.sample import Sample

    Pair = namedtuple("Pair", "logits extra")

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor, scale: float, mask: torch.Tensor) -> dict:
            return {"pair": Pair(x * scale, mask.float()), "sum": x.sum(1)}

    x, mask = torch.randn(4, 3), torch.ones(5, dtype=torch.bool)
    written = engine_saved.signature_of(Sample(Model(), (x, 2.0, mask)))
    signature = engine_saved.Signature(json.loads(json.dumps(written)))
    assert signature.describe() == "(float32[N,3], 2.0, bool[5])"
    assert signature.tensor_positions == [0, 2] and signature.mismatch((x[:2], 2.0, mask)) is None
    assert "argument 1 was exported as 2.0" in signature.mismatch((x, 3.0, mask))
    assert "argument 2 is bool[4]" in signature.mismatch((x, 2.0, mask[:4]))
    flat = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    out = signature.structure(flat)
    assert type(out["pair"]) is tuple and out["pair"][1] is flat[1] and out["sum"] is flat[2]
    with pytest.raises(ValueError, match="input 0 is not a tensor spec"):
        engine_saved.Signature({**written, "inputs": [{"dtype": "os.system", "shape": [None]}]})


def test_a_bf16_variant_auto_keeps_saves_and_loads_without_torchao(tmp_path: Path, quantized: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever ``auto`` may keep can be saved: its bf16 float variant (the fixture's ``"bf16"``)
    saves as the float program under bf16 autocast and loads with the outputs it gave (bf16
    tolerance: the engine differs), any batch, computed in bf16, and without torchao (a float
    program holds none of its ops; importing it took seconds). test_quantize.py's
    ``test_save_then_load_in_a_fresh_process`` loads it in its fresh process too."""
    if isinstance(quantized["bf16"], str):
        pytest.skip(quantized["bf16"])
    q, x = quantized["bf16"]
    target = tmp_path / "bf16.pt2"
    q.save(str(target))
    assert _manifest(target)["mode"] == "bf16"
    monkeypatch.setitem(sys.modules, "torchao", None)   # importing it raises ImportError
    loaded = load_quantized(str(target))
    with torch.no_grad():
        got, expected, plain = loaded(x), q(x), tiny_mlp()(x)   # the fp32 model the fixture quantized
        assert loaded(x[:3]).shape == (3, *expected.shape[1:])
    assert loaded.mode == "bf16" and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    assert not torch.equal(got, plain)   # computed in bf16, not the fp32 model


def test_pickling_a_quantized_model_says_to_save_it(quantized: dict) -> None:
    """``torch.save(qmodel)`` failed inside pickle (``'functools.partial' object has no attribute
    '__name__'``); it is one TypeError naming ``save``/``load_quantized``, and a deep copy still works."""
    import copy
    import io

    if isinstance(quantized["weight_only"], str):
        pytest.skip(quantized["weight_only"])
    q, x = quantized["weight_only"]
    with pytest.raises(TypeError, match=r"^a quantized model \(weight_only\) is not pickled .*model\.save\(path\) "
                                        r"and load it with xlaunch\.load_quantized\(path\)$"):
        torch.save(q, io.BytesIO())
    twin = copy.deepcopy(q)
    with torch.no_grad():
        assert twin.mode == q.mode and torch.equal(twin(x), q(x))


def test_every_route_deep_copies(quantized: dict, tmp_path: Path) -> None:
    """``copy.deepcopy(qmodel)`` (documented to work) raised pickle's ``cannot pickle 'InferenceSession'``,
    ``'CompiledModel'`` or ``'_thread.lock'`` for the engine and compiled routes, returned or loaded:
    such a copy now shares the runner (read-only at inference) and copies the rest."""
    import copy

    built = {route: value for route, value in quantized.items() if not isinstance(value, str)}
    if not built:
        pytest.skip("no route builds here")
    for route, (q, x) in built.items():
        models = [q]
        if route in ENGINE_ROUTES:   # a loaded engine model too
            q.save(str(tmp_path / f"{route}.xq"))
            models.append(load_quantized(str(tmp_path / f"{route}.xq")))
        for model in models:
            twin = copy.deepcopy(model)
            with torch.no_grad():
                assert twin.mode == model.mode and torch.equal(twin(x), model(x)), route
            assert twin.report is not model.report and twin.report == model.report


@pytest.mark.parametrize("mode", ["weight_only", "dynamic"])
def test_an_example_batch_of_one_gives_a_model_for_every_batch_size(tmp_path: Path, mode: str) -> None:
    """export specialized an example's batch of 1 to 1: the quantized model (dynamic) and the loaded one
    (weight_only too) then refused batch 4 ('Guard failed: input.size()[0] == 1')."""
    from xlaunch.kernels.quantize import quantize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    quantized = quantize(model, (torch.randn(1, 16),), mode=mode, progress=False)
    quantized.save(str(tmp_path / "one.pt2"))
    loaded = load_quantized(str(tmp_path / "one.pt2"))
    x = torch.randn(4, 16)
    with torch.no_grad():
        for runner in (quantized, loaded):
            for rows in (x, x[:1]):
                out, ref = runner(rows), model(rows)
                assert out.shape == ref.shape and (out - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("name", ["", "missing/", "{tmp}/"])
def test_a_path_that_names_no_file_is_refused_before_writing(tmp_path: Path, monkeypatch, name: str) -> None:
    """'' wrote a whole temporary file into the parent of the working directory, then failed to rename
    it onto '' (FileNotFoundError naming the temporary file); 'missing/' wrote it into the working directory."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    name = name.format(tmp=tmp_path)
    with pytest.raises(ValueError, match="names no file"):
        saved.write_new(name, lambda handle: handle.write(b"x"))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["work"]


def test_a_model_quantized_or_saved_under_inference_mode_saves(tmp_path) -> None:
    """``quantize`` called under ``torch.inference_mode`` (inputs made there too) and saved outside it,
    and one quantized outside and saved there: each file loads and gives the same outputs. Before,
    save was one ValueError (``torch.export cannot capture ...: Inference tensors cannot be saved for
    backward``, ``Cannot set version_counter for inference tensor``). weight_only: cheap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.inference_mode():
            inside = quantize(model, x.clone(), calibration=[(torch.randn(4, 16),)], mode="weight_only", progress=False)
        outside = quantize(model, x, calibration=[(torch.randn(4, 16),)], mode="weight_only", progress=False)
    inside.save(str(tmp_path / "quantized_inside.pt2"))
    with torch.inference_mode():
        outside.save(str(tmp_path / "saved_inside.pt2"))
    for name, quantized in (("quantized_inside.pt2", inside), ("saved_inside.pt2", outside)):
        loaded = load_quantized(str(tmp_path / name))
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), quantized(x), rtol=1e-5, atol=1e-6)


def test_a_path_that_is_no_path_and_a_call_the_loaded_program_does_not_serve(tmp_path) -> None:
    """``save``/``load_quantized`` given no path are one TypeError naming the argument (was os.fspath's
    ``expected str, bytes or os.PathLike object``; ``save(bytes)`` was ``a bytes-like object is
    required``); a loaded torch program called with a wrong dtype or feature shape is one ValueError
    naming its signature, as an engine's (was ``AssertionError: Guard failed: input.size()[1] == 16``)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(nn.Sequential(nn.Linear(16, 4)).eval(), torch.randn(4, 16), mode="weight_only",
                             progress=False)
    for bad in (None, 3):
        with pytest.raises(TypeError, match=rf"^save: path must be a str or os.PathLike \(a file's path\), "
                                            rf"not {type(bad).__name__}$"):
            quantized.save(bad)
        with pytest.raises(TypeError, match=rf"^load_quantized: path must be a str or os.PathLike .*, "
                                            rf"not {type(bad).__name__}$"):
            load_quantized(bad)
    for empty in ("", b""):      # was "load_quantized: : no such file"
        with pytest.raises(ValueError, match=r"^save: '' names no file \(give a file's path, e.g. model.pt2\)$"):
            quantized.save(empty)
        with pytest.raises(ValueError, match=r"^load_quantized: '' names no file \(give a file's path"):
            load_quantized(empty)
    path = tmp_path / "m.pt2"
    quantized.save(os.fsencode(path))   # bytes, as load_quantized takes them
    loaded = load_quantized(os.fsencode(path))
    with torch.no_grad():
        assert loaded(torch.randn(3, 16)).shape == (3, 4)
        for bad, got in ((torch.randn(3, 8), "float32[3,8]"), (torch.randn(3, 16).double(), "float64[3,16]"),
                         (torch.randn(16), "float32[16]")):
            with pytest.raises(ValueError, match=rf"^weight_only model {path}: takes \(float32\[N,16\]\); "
                                                 rf"argument 0 is {re.escape(got)} on cpu$"):
                loaded(bad)
        with pytest.raises(ValueError, match=r"takes 1 argument\(s\) \(float32\[N,16\]\), got 2"):
            loaded(torch.randn(3, 16), torch.randn(3, 16))


class Scaled(nn.Module):
    """A plain (non-tensor) argument, which torch.export bakes into the program as its value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.linear(x) * scale


def test_a_baked_plain_argument_is_in_the_manifest_and_checked(tmp_path) -> None:
    """The manifest's ``inputs`` left a baked plain argument out (``[float32[N,16]]`` for
    ``forward(x, scale)``), so they did not line up with the call; it is recorded as its value now,
    and a call with another value is one ValueError (the program raised ``AssertionError: Guard
    failed: scale == 2.0``). A file saved before, without the value, loads and runs unchecked."""
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(Scaled().eval(), (x, 2.0), mode="weight_only", progress=False)
    path = tmp_path / "scaled.pt2"
    quantized.save(str(path))
    meta = _manifest(path)
    assert meta["inputs"] == [{"dtype": "float32", "shape": [None, 16]}, {"value": 2.0}]
    loaded = load_quantized(str(path))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, 2.0), quantized(x, 2.0), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=rf"^weight_only model {path}: argument 1 was exported as 2.0, got 3.0$"):
            loaded(x, 3.0)
    older = tmp_path / "older.pt2"   # as saved before: the value left out
    torch.export.save(torch.export.load(str(path)), str(older),
                      extra_files={saved.META_FILE: json.dumps({**meta, "inputs": meta["inputs"][:1]})})
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(str(older))(x, 2.0), quantized(x, 2.0), rtol=1e-5, atol=1e-6)
