"""A checkpoint folder a user hands xlaunch.llm.from_pretrained, mutated: config.json and generation_config.json
that are no regular file or no JSON object, an untied config without lm_head.weight, header entries over the same
bytes, an index naming no files. Each is one ValueError line naming the file, before any weight is packed."""
from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fifos import fifo_with_late_writer  # noqa: E402
from llm_models import VOCAB, tiny  # noqa: E402

import xlaunch.llm as llm  # noqa: E402
from xlaunch.llm import loader  # noqa: E402
from xlaunch.llm.packed_file import PackedFileError  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: directory}: a tiny untied Llama in one file, a tiny Qwen2 in shards with an index."""
    root = tmp_path_factory.mktemp("saved")
    tiny("llama").save_pretrained(root / "llama", safe_serialization=True)
    tiny("qwen2", seed=3).save_pretrained(root / "qwen2", safe_serialization=True, max_shard_size="200KB")
    return {"llama": root / "llama", "qwen2": root / "qwen2"}


@pytest.fixture
def nothing_packed(monkeypatch):
    monkeypatch.setattr(loader, "stream_linear", lambda *args, **kwargs: pytest.fail("a weight was packed first"))


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _one_line_error(path: Path, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        llm.from_pretrained(path, dtype=torch.float32)
    assert "\n" not in str(info.value) and str(info.value).startswith("xlaunch.llm.from_pretrained: ")
    return str(info.value)


def _ids():
    return torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_config_file_that_is_no_regular_file_is_one_line_naming_it(saved, tmp_path, name, nothing_packed):
    """A FIFO, a directory, /dev/null or a dangling link named generation_config.json was skipped silently
    (generate used config.json's defaults, not the file's settings); named config.json, it said 'has no config.json'."""
    for kind, plant in (("FIFO", None), ("directory", os.mkdir), ("character device", lambda p: p.symlink_to("/dev/null")),
                        ("dangling", lambda p: p.symlink_to("nowhere"))):
        folder = _copy(saved["llama"], tmp_path / kind.replace(" ", "-"))
        (folder / name).unlink()
        if plant is None:
            with fifo_with_late_writer(folder / name):      # a blocking read would meet the writer, then fail here
                _one_line_error(folder, f"{name} is a FIFO, not a regular file$")
            continue
        plant(folder / name)
        _one_line_error(folder, f"cannot read .*{name}: No such file or directory$" if kind == "dangling"
                        else f"{name} is a {kind}, not a regular file$")
    folder = _copy(saved["llama"], tmp_path / "absent")
    (folder / name).unlink()
    if name == "config.json":
        _one_line_error(folder, "has no config.json$")


def test_an_untied_config_without_lm_head_is_one_line_saying_what_to_do(saved, tmp_path, nothing_packed):
    """transformers loads it with a random lm_head (its load report says MISSING): refused, the line naming the
    tensor and the config key, whether tie_word_embeddings is false or absent (false for these model types)."""
    from safetensors.torch import load_file, save_file

    folder = _copy(saved["llama"], tmp_path / "no-head")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: t for k, t in tensors.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    for absent in (False, True):
        if absent:
            config.pop("tie_word_embeddings")
            (folder / "config.json").write_text(json.dumps(config))
        _one_line_error(folder, "lacks the tensor lm_head.weight, and its config.json does not tie lm_head to the "
                                "embedding .* set \"tie_word_embeddings\": true in config.json$")


def test_an_untied_config_set_to_tie_loads_as_transformers_ties_it(saved, tmp_path):
    """The line's advice, followed: the same logits as transformers' tied model."""
    from safetensors.torch import load_file, save_file

    folder = _copy(saved["llama"], tmp_path / "tied-now")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: t for k, t in tensors.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    reference = llm.optimize(transformers.AutoModelForCausalLM.from_pretrained(folder), dtype=torch.float32)
    ids = _ids()
    assert torch.equal(llm.from_pretrained(folder, dtype=torch.float32)(ids).logits, reference(ids).logits)


def test_a_config_that_is_no_json_object_or_fails_validation_is_one_whole_line(saved, tmp_path, nothing_packed):
    """A list or a number said 'Unrecognized model ... should have a model_type key' or "argument of type 'int' is
    not iterable"; a validation error was cut at its first line ("Validation error for field 'hidden_size':"),
    the line saying what is wrong with the field lost."""
    folder = _copy(saved["llama"], tmp_path / "config")
    config = json.loads((folder / "config.json").read_text())
    for text, match in (("[1, 2]", "holds an array, not a JSON object"), ("128", "holds a number, not a JSON object"),
                        ("null", "holds null, not a JSON object"), ("", "is not JSON \\(JSONDecodeError"),
                        ("[" * 100000, "is not JSON \\(RecursionError"),
                        (json.dumps(dict(config, hidden_size="128")),
                         "is not a config transformers can use .*field 'hidden_size': .*expected int, got str")):
        (folder / "config.json").write_text(text)
        _one_line_error(folder, f"config.json {match}")


def _rewrite_header(path: Path, change) -> None:
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])


def test_header_entries_over_the_same_bytes_are_refused(saved, tmp_path, nothing_packed):
    """safetensors refuses such a file; v_proj read k_proj's values and the model loaded."""
    folder = _copy(saved["llama"], tmp_path / "overlap")
    prefix = "model.layers.0.self_attn"

    def share(header):
        header[f"{prefix}.v_proj.weight"]["data_offsets"] = header[f"{prefix}.k_proj.weight"]["data_offsets"]

    _rewrite_header(folder / "model.safetensors", share)
    _one_line_error(folder, f"{prefix}.[kv]_proj.weight and {prefix}.[kv]_proj.weight in .* share bytes")


def test_an_index_naming_no_files_says_so(saved, tmp_path):
    """It said 'has no *.safetensors file' beside ten shards."""
    folder = _copy(saved["qwen2"], tmp_path / "empty-index")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    _one_line_error(folder, "model.safetensors.index.json names no files")


def test_the_checkpoint_still_loads_with_every_file_as_saved(saved):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = llm.from_pretrained(saved["llama"], dtype=torch.float32)
    assert model.generation_config.eos_token_id == 2 and torch.isfinite(model(_ids()).logits).all()


@pytest.mark.parametrize("arguments,error,match", [
    (dict(path="a\0b"), ValueError, "path holds a NUL character"),          # was "embedded null byte", naming nothing
    (dict(path="x.xlp", source="a\0b"), ValueError, "source holds a NUL character"),
    (dict(group_size="128"), TypeError, "group_size must be an integer, not '128'"),     # a TypeError mid-stream
    (dict(private="yes"), TypeError, "private must be True or False, not 'yes'"),        # taken as True
    (dict(node_copy="no"), TypeError, "node_copy must be True or False, not 'no'")])     # taken as True
def test_an_argument_of_the_wrong_kind_is_one_line_naming_it(saved, arguments, error, match, nothing_packed):
    arguments = dict(dict(path=saved["llama"]), **arguments)
    with pytest.raises(error, match=f"^xlaunch.llm.from_pretrained: {match}"):
        llm.from_pretrained(**arguments)


def test_a_packed_file_that_cannot_be_written_is_refused_before_the_source_is_streamed(saved, tmp_path, monkeypatch):
    """from_pretrained(path, source=...) streamed the whole checkpoint (minutes for a large one), then refused to
    write path: a folder (path and source swapped), a folder that does not exist (a typo), a link."""
    monkeypatch.setattr(loader, "load_checkpoint", lambda *args, **kwargs: pytest.fail("the source was streamed first"))
    (tmp_path / "link.xlp").symlink_to(tmp_path / "elsewhere.xlp")
    for path, match in ((saved["qwen2"], "is not a regular file \\(never replaced\\)"),
                        (tmp_path / "no-such-folder" / "model.xlp", "cannot write .* \\(No such file or directory\\)"),
                        (tmp_path / "link.xlp", "is a symlink; give the file's own path")):
        with pytest.raises(PackedFileError, match=f"^xlaunch.llm.save_packed: .*{match}$"):
            llm.from_pretrained(path, source=saved["llama"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.xlp"]


@pytest.mark.parametrize("architecture", ["LlamaForSequenceClassification", "LlamaModel"])
def test_a_checkpoint_of_no_causal_lm_says_what_it_holds(tmp_path, architecture, nothing_packed):
    """A classifier's or a base model's checkpoint was told to tie its embeddings to the lm_head it lacks."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, num_labels=3)
    getattr(transformers, architecture)(config).save_pretrained(tmp_path / "other")
    _one_line_error(tmp_path / "other", f"holds a {architecture} \\(its config.json's architectures\\), not a causal LM")


def test_tensors_the_config_does_not_read_are_named_in_one_warning(saved, tmp_path):
    """A config of fewer layers than stored loaded the first layers in silence (transformers lists the rest as
    UNEXPECTED); the rotary inv_freq old conversions store is skipped without a word, as transformers skips it."""
    from safetensors.torch import load_file, save_file

    folder = _copy(saved["llama"], tmp_path / "fewer")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    reference = llm.optimize(transformers.AutoModelForCausalLM.from_pretrained(folder), dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = llm.from_pretrained(folder, dtype=torch.float32)
    said = [w for w in caught if "does not read" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in caught]
    assert "stores 9 tensor(s)" in str(said[0].message) and "model.layers.1.input_layernorm.weight" in str(said[0].message)
    assert "inv_freq" not in str(said[0].message)
    ids = _ids()
    assert torch.equal(ours(ids).logits, reference(ids).logits)


def test_a_byte_order_mark_or_a_generation_config_that_is_no_json_is_said(saved, tmp_path, nothing_packed):
    """transformers reads neither a config.json behind a UTF-8 byte-order mark (Windows editors write one: "not a
    valid JSON file") nor such a generation_config.json, which it skips without a word, and so did the loader."""
    import codecs

    folder = _copy(saved["llama"], tmp_path / "bom")
    config = (folder / "config.json").read_bytes()
    (folder / "config.json").write_bytes(codecs.BOM_UTF8 + config)
    _one_line_error(folder, "config.json begins with a UTF-8 byte-order mark, which transformers does not read")
    (folder / "config.json").write_bytes(config)
    settings = json.loads((folder / "generation_config.json").read_text())
    for text, problem in ((codecs.BOM_UTF8 + json.dumps(dict(settings, eos_token_id=7)).encode(), "begins with a UTF-8"),
                          (b"{not json", "is not JSON \\(JSONDecodeError")):
        (folder / "generation_config.json").write_bytes(text)
        with pytest.raises(UserWarning, match=f"generation_config.json {problem}.*: skipped, as transformers skips it"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                llm.from_pretrained(folder, dtype=torch.float32)


def test_a_hugging_face_cache_folder_names_its_snapshot(saved, tmp_path):
    """models--org--name/ holds the checkpoint in snapshots/<revision>/ (links into blobs/): 'has no config.json'
    alone left the user to find it."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(saved["llama"].iterdir())):
        (repo / "blobs" / f"blob{index}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/blob{index}")
    message = _one_line_error(repo, "has no config.json \\(a Hugging Face cache folder: give .*$")
    assert message.endswith(f"give {snapshot})")
    assert torch.isfinite(llm.from_pretrained(snapshot, dtype=torch.float32)(_ids()).logits).all()
    (repo / "snapshots" / "4567ef00").mkdir()
    _one_line_error(repo, f"a Hugging Face cache folder: give one of {repo / 'snapshots'}/\\*\\)$")
