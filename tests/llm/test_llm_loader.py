"""xlaunch.llm.from_pretrained streams a safetensors checkpoint into the packed layout: the same logits and
tokens as optimize() of the model loaded normally, in every precision, tied and sharded checkpoints, and a
peak RSS (measured in a subprocess) near the packed weights plus the KV cache."""
from __future__ import annotations

import json
import os
import subprocess
import warnings
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from llm_models import VOCAB, tiny  # noqa: E402

import xlaunch.llm as llm  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[2]
PRECISIONS = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8"), (torch.bfloat16, "int4")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: directory}: a plain Llama, one with tied embeddings, a Qwen2 (q/k/v biases) in three shards."""
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name, model, shard in (("llama", tiny("llama"), None), ("tied", tiny("llama", tie_word_embeddings=True), None),
                               ("qwen2", tiny("qwen2", seed=3), "200KB")):
        extra = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(root / name, safe_serialization=True, **extra)
        made[name] = root / name
    tiny("llama", seed=4).to(torch.bfloat16).save_pretrained(root / "bf16")
    made["bf16"] = root / "bf16"      # a bf16 checkpoint: its embedding stays bf16 under fp32 activations
    assert (made["qwen2"] / "model.safetensors.index.json").is_file()
    return made


def _ids():
    return torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


# every precision on the plain Llama; the tied and sharded Qwen2 checkpoints in bf16 and int4
CASES = [("llama", *p) for p in PRECISIONS] + [(name, *p) for name in ("tied", "qwen2") for p in PRECISIONS[1::2]]
CASES += [("bf16", torch.float32, "int8"), ("bf16", torch.float32, "int4"), ("bf16", torch.float32, None)]


@pytest.mark.parametrize("name,dtype,weights", CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_streamed_model_matches_optimize_of_the_loaded_model(checkpoints, name, dtype, weights):
    path = checkpoints[name]
    reference = llm.optimize(transformers.AutoModelForCausalLM.from_pretrained(path), dtype=dtype, weights=weights)
    ours = llm.from_pretrained(path, dtype=dtype, weights=weights)
    assert llm.is_optimized(ours) and type(ours) is type(reference)
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
    if name == "tied":       # one copy: the embedding's rows are the packed lm_head's
        for model in (ours, reference):
            assert model.model.embed_tokens.weight is None and model.model.embed_tokens.lm_head is model.lm_head
    else:
        table = torch.bfloat16 if name == "bf16" else dtype
        assert ours.model.embed_tokens.weight.dtype == reference.model.embed_tokens.weight.dtype == table
    assert ours.dtype == reference.dtype == dtype
    if (name, dtype, weights) == ("bf16", torch.float32, None):   # bf16 values in fp32: stored as bf16 ...
        from xlaunch.llm import native

        stored = torch.bfloat16 if native.ops() is not None else torch.float32   # ... in the kernels' layout (in use)
        assert all(m.weight.dtype == stored for model in (ours, reference) for m in model.modules()
                   if isinstance(m, llm.PackedLinear))
    ids = _ids()
    assert torch.equal(ours(ids).logits, reference(ids).logits)
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), expected)


def test_a_directory_without_a_checkpoint_gets_one_line(tmp_path):
    with pytest.raises(ValueError, match="has no config.json") as info:
        llm.from_pretrained(tmp_path)
    assert "\n" not in str(info.value)


PEAK_PROGRAM = r"""
import json, sys, gc, torch, warnings
import xlaunch.llm as llm
from transformers import AutoModelForCausalLM

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

small, big, route = sys.argv[1:4]
warnings.simplefilter("ignore")                   # bf16 on a CPU without native bf16 warns (as it should)
ids = torch.randint(1, 500, (1, 16), generator=torch.Generator().manual_seed(0))
warm = llm.from_pretrained(small, dtype=torch.bfloat16)   # imports, kernels and allocator warmed on a tiny model
warm.generate(ids, max_new_tokens=4, do_sample=False)
del warm
gc.collect()
baseline = hwm()
if route == "stream":   # INT8: chunks quantized and packed, the temporaries glibc would keep
    model = llm.from_pretrained(big, dtype=torch.bfloat16, weights="int8")
else:
    model = llm.optimize(AutoModelForCausalLM.from_pretrained(big), dtype=torch.bfloat16)
out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
runtime = model._xlaunch_llm
tensors = [*([] if runtime.embed is None else [runtime.embed]), runtime.final_norm, *(t for layer in runtime.layers
           for t in (layer.input_norm, layer.post_attention_norm))]
tensors += [t for linear in [runtime.lm_head, *(l for layer in runtime.layers for l in
            (layer.qkv, layer.out, layer.gate_up, layer.down))] for t in (linear.weight, linear.scales, linear.bias)
            if t is not None]
cache = out.past_key_values
packed = sum(t.numel() * t.element_size() for t in tensors)
kv = sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values])
print(json.dumps(dict(baseline=baseline, peak=hwm(), packed=packed, kv=kv)))
"""


def _big_checkpoint(path: Path) -> int:
    """A random bf16 Llama of about 125 MB (4 layers of hidden 1024, vocabulary 8192), written tensor by tensor."""
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    config.save_pretrained(path)
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    hidden, inter, kv = 1024, 2816, 4 * 64
    tensors = {"model.embed_tokens.weight": rand(8192, hidden), "lm_head.weight": rand(8192, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(4):
        p = f"model.layers.{i}"
        tensors.update({f"{p}.self_attn.q_proj.weight": rand(hidden, hidden), f"{p}.self_attn.k_proj.weight":
                        rand(kv, hidden), f"{p}.self_attn.v_proj.weight": rand(kv, hidden),
                        f"{p}.self_attn.o_proj.weight": rand(hidden, hidden), f"{p}.mlp.gate_proj.weight":
                        rand(inter, hidden), f"{p}.mlp.up_proj.weight": rand(inter, hidden),
                        f"{p}.mlp.down_proj.weight": rand(hidden, inter),
                        f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                        f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
    save_file(tensors, str(path / "model.safetensors"))
    return sum(t.numel() * 2 for t in tensors.values())


def test_streamed_load_peaks_near_the_packed_weights_plus_the_kv_cache(checkpoints, tmp_path):
    size = _big_checkpoint(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PEAK_PROGRAM, str(checkpoints["llama"]), str(tmp_path), "stream"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # a decoding run in a fresh process: transformers imports torchao as it builds the model, whose import
    # logs misses of CUDA-only libraries and pytree deprecations; xlaunch.llm imports it quietly first
    assert "Failed to load" not in done.stderr and "register_constant" not in done.stderr, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.5 * size <= found["packed"] <= 0.6 * size    # bf16 to INT8: half, plus the scales
    growth = found["peak"] - found["baseline"]
    # 1.15x, plus 4 MiB: the loader gives glibc's heap back after each linear (release_free_heap); without
    # that the freed 1 MiB read/pack chunks stayed resident, 9.5 MiB past 1.15x here (90 MiB for a 1B
    # model); a mapped checkpoint (safe_open: +125 MB of file pages) or a full-precision copy breaks it
    assert growth <= 1.15 * (found["packed"] + found["kv"]) + (4 << 20), (found, growth / found["packed"])


# --- a checkpoint folder a user hands us: regular files inside it, headers that hold together -----------------
def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _rewrite_header(path: Path, change) -> None:
    """Rewrite a safetensors file's header with ``change(header)`` applied (the data stays where it was)."""
    import struct

    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])


def _one_line_error(path: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        llm.from_pretrained(path, dtype=torch.float32)
    assert "\n" not in str(info.value) and str(info.value).startswith("xlaunch.llm.from_pretrained: ")


def test_a_fifo_or_a_device_named_like_a_shard_is_refused_without_blocking(checkpoints, tmp_path):
    """Opened blocking, a FIFO with no writer hung from_pretrained for good (fifos.py keeps a regression from
    hanging the worker)."""
    from fifos import fifo_with_late_writer

    folder = _copy(checkpoints["llama"], tmp_path / "fifo")
    (folder / "model.safetensors").unlink()
    with fifo_with_late_writer(folder / "model.safetensors"):
        _one_line_error(folder, "model.safetensors is a FIFO, not a regular file")
    device = _copy(checkpoints["llama"], tmp_path / "device")
    (device / "model.safetensors").unlink()
    (device / "model.safetensors").symlink_to("/dev/zero")
    _one_line_error(device, "is a character device, not a regular file")


def test_an_index_naming_files_outside_the_folder_is_refused(checkpoints, tmp_path):
    folder = _copy(checkpoints["qwen2"], tmp_path / "outside")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    for name in ("../outside.safetensors", "/etc/passwd", ".."):
        index["weight_map"][first] = name
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        _one_line_error(folder, "names a file outside")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    _one_line_error(folder, "has no weight_map")
    (folder / "model.safetensors.index.json").write_text("[" * 100000)
    _one_line_error(folder, "has no weight_map")
    (folder / "model.safetensors.index.json").write_bytes(b" " * (17 << 20))
    _one_line_error(folder, "index.json")


def test_a_header_whose_ranges_do_not_hold_its_shapes_is_refused(checkpoints, tmp_path):
    """A shape larger than its bytes would read the next tensor's data as its own: refused, as is a range past
    the file's end, a negative size or a header that is not an object."""
    cases = {
        "larger": (lambda h: h["model.norm.weight"].update(shape=[h["model.norm.weight"]["shape"][0] * 2]),
                   "holds .* bytes, but its shape"),
        "past the end": (lambda h: h["model.norm.weight"].update(data_offsets=[0, 1 << 40]), "outside the file's data"),
        "negative": (lambda h: h["model.norm.weight"].update(shape=[-4]), "has no valid shape"),
        "not an entry": (lambda h: h.update({"model.norm.weight": 3}), "is not a tensor entry"),
        "no dtype": (lambda h: h["model.layers.0.mlp.down_proj.weight"].pop("dtype"), "has no dtype"),
        "list dtype": (lambda h: h["model.norm.weight"].update(dtype=["F32"]), "has no dtype"),
    }
    for label, (change, match) in cases.items():
        folder = _copy(checkpoints["llama"], tmp_path / label.replace(" ", "-"))
        _rewrite_header(folder / "model.safetensors", change)
        _one_line_error(folder, match)


def test_a_tensor_of_another_shape_than_the_config_is_refused(checkpoints, tmp_path):
    """Both headers consistent, but o_proj's shape is not the config's: named, before anything is packed."""
    from safetensors.torch import load_file, save_file

    folder = _copy(checkpoints["llama"], tmp_path / "reshaped")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :-8].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    _one_line_error(folder, f"{name} in .* is \\[.*\\], not the \\[.*\\] of its config.json")


def test_a_config_transformers_refuses_or_cannot_build_is_one_line(checkpoints, tmp_path):
    """Found by mutating config.json value by value: transformers' validation errors (several lines), a
    model type it does not know, a size its checks let through that fails the model's construction, and
    no layers at all (loaded, then IndexError or logits of the embedding alone) reached the caller as
    they were."""
    cases = {"vocab_size": ("x", "is not a config transformers can use .*vocab_size"),
             "model_type": ("F64", "is not a config transformers can use .*F64"),
             "head_dim": (-1, "its config does not build a model"),
             "num_hidden_layers": (-1, "has no decoder layers")}
    for key, (value, match) in cases.items():
        folder = _copy(checkpoints["llama"], tmp_path / key)
        config = json.loads((folder / "config.json").read_text())
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        _one_line_error(folder, match)



# --- the files transformers reads, and what it does with them ------------------------------------------------
def test_only_model_safetensors_is_read_beside_other_safetensors_files(checkpoints, tmp_path):
    """An EMA copy (same names, other values) beside model.safetensors was read too, and a name in two files took
    the last file's values: the EMA's logits. transformers reads model.safetensors alone (else the index's shards);
    with neither, files that share a name are one line, and a folder of pytorch_model.bin says so."""
    from safetensors.torch import load_file, save_file

    folder = _copy(checkpoints["llama"], tmp_path / "ema")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({name: t * 0.5 for name, t in tensors.items()}, str(folder / "model_ema.safetensors"))
    reference = llm.optimize(transformers.AutoModelForCausalLM.from_pretrained(folder), dtype=torch.float32)
    ids = _ids()
    assert torch.equal(llm.from_pretrained(folder, dtype=torch.float32)(ids).logits, reference(ids).logits)
    (folder / "model.safetensors").rename(folder / "model-copy.safetensors")       # no model.safetensors, no index
    _one_line_error(folder, "weight is in both model-copy.safetensors and model_ema.safetensors")
    for name in ("model-copy.safetensors", "model_ema.safetensors"):
        (folder / name).unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    _one_line_error(folder, "has no \\*.safetensors file \\(only pytorch_model.bin")


def test_a_tied_config_whose_checkpoint_stores_another_lm_head_is_not_tied(checkpoints, tmp_path):
    """tie_word_embeddings, but lm_head.weight and the embedding stored with different values: transformers
    warns and does not tie them; the loader tied them (both from lm_head.weight: other logits). Equal copies
    (as .bin conversions store them) stay tied: one matrix."""
    from safetensors.torch import load_file, save_file

    folder = _copy(checkpoints["tied"], tmp_path / "two-heads")
    tensors = load_file(str(folder / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]
    ids = _ids()
    for head, tied in ((embedding.clone(), True), (embedding.flip(0).contiguous(), False)):
        save_file(dict(tensors, **{"lm_head.weight": head}), str(folder / "model.safetensors"), metadata={"format": "pt"})
        reference = llm.optimize(transformers.AutoModelForCausalLM.from_pretrained(folder), dtype=torch.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = llm.from_pretrained(folder, dtype=torch.float32)
        said = [str(w.message) for w in caught if "different values: not tied" in str(w.message)]
        assert len(said) == (0 if tied else 1) and all(w.filename == __file__ for w in caught if str(w.message) in said)
        assert (ours.model.embed_tokens.weight is None) is tied
        assert torch.equal(ours(ids).logits, reference(ids).logits)


VOCAB_PEAK_PROGRAM = """
import gc, json, sys, torch, warnings
import xlaunch.llm as llm

def peak_since_reset():
    return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmHWM:"))

warnings.simplefilter("ignore")                   # bf16 on a CPU without native bf16 warns (as it should)
found = {}
for name, path, dtype, weights in (("tied fp32", sys.argv[1], torch.float32, None),
                                   ("untied F32 to bf16", sys.argv[2], torch.bfloat16, "int8")):
    llm.from_pretrained(sys.argv[3], dtype=dtype, weights=weights)(torch.ones(1, 4, dtype=torch.long))  # imports
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")     # the peak RSS starts again from the present RSS
    baseline = peak_since_reset()
    model = llm.from_pretrained(path, dtype=dtype, weights=weights)
    growth = peak_since_reset() - baseline
    runtime = model._xlaunch_llm
    linears = [runtime.lm_head, *(l for layer in runtime.layers for l in (layer.qkv, layer.out, layer.gate_up, layer.down))]
    tensors = [t for linear in linears for t in (linear.weight, linear.scales, linear.bias) if t is not None]
    tensors += [] if runtime.embed is None else [runtime.embed]
    found[name] = dict(growth=growth, packed=sum(t.numel() * t.element_size() for t in tensors))
    del model, runtime, linears, tensors
print(json.dumps(found))
"""


def _vocab_heavy_checkpoint(path: Path, tied: bool, dtype) -> Path:
    """A one-layer Llama whose vocabulary matrix (32768 x 512) is most of it."""
    from safetensors.torch import save_file

    transformers.LlamaConfig(vocab_size=32768, hidden_size=512, intermediate_size=512, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=tied).save_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (32768, 512), "model.norm.weight": (512,),
              **({} if tied else {"lm_head.weight": (32768, 512)})}
    for part, (n, k) in {"self_attn.q_proj": (512, 512), "self_attn.k_proj": (512, 512), "self_attn.v_proj": (512, 512),
                         "self_attn.o_proj": (512, 512), "mlp.gate_proj": (512, 512), "mlp.up_proj": (512, 512),
                         "mlp.down_proj": (512, 512)}.items():
        shapes[f"model.layers.0.{part}.weight"] = (n, k)
    shapes.update({f"model.layers.0.{norm}.weight": (512,) for norm in ("input_layernorm", "post_attention_layernorm")})
    save_file({name: (torch.randn(shape, generator=generator) * 0.02).to(dtype) for name, shape in shapes.items()},
              str(path / "model.safetensors"))
    return path


def test_vocabulary_matrices_are_streamed_in_every_precision(checkpoints, tmp_path):
    """Under fp32 activations (the default without native bf16) each weight was read whole and copied twice (a
    bf16 tied lm_head: three times its packed size at once), and an fp32 embedding cast to bf16 was read whole
    first: the peak RSS grew by 2.8x / 2.3x the packed weights here. Now by chunks: near the packed weights."""
    try:        # the program resets its peak RSS between the two loads (Linux 4.0 and later)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError as error:
        pytest.skip(f"the peak RSS cannot be reset here (/proc/self/clear_refs: {error.strerror})")
    tied = _vocab_heavy_checkpoint(tmp_path / "tied", True, torch.bfloat16)
    untied = _vocab_heavy_checkpoint(tmp_path / "untied", False, torch.float32)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", VOCAB_PEAK_PROGRAM, str(tied), str(untied), str(checkpoints["tied"])],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-3000:]
    for name, found in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert found["growth"] <= 1.15 * found["packed"] + (4 << 20), (name, found, found["growth"] / found["packed"])


def test_a_generation_config_transformers_refuses_is_one_line_before_any_weight_is_read(checkpoints, tmp_path,
                                                                                        monkeypatch):
    """transformers' own errors (a ValueError without the file's name, a TypeError) came after every weight was
    streamed; a generation_config.json that is not JSON is skipped, as transformers' own load does."""
    from xlaunch.llm import loader

    folder = _copy(checkpoints["llama"], tmp_path / "generation")
    with monkeypatch.context() as patch:
        patch.setattr(loader, "stream_linear", lambda *args, **kwargs: pytest.fail("a weight was read first"))
        for text, match in (('{"max_new_tokens": -1}', "max_new_tokens"), ('[1, 2]', "not a mapping"),
                            ('{"pad_token_id": "a"}', "TypeError")):
            (folder / "generation_config.json").write_text(text)
            _one_line_error(folder, f"generation_config.json is not a generation config transformers can use .*{match}")
    (folder / "generation_config.json").write_text("{not json")
    with pytest.warns(UserWarning, match="generation_config.json is not JSON .*: skipped, as transformers skips it"):
        assert llm.from_pretrained(folder, dtype=torch.float32).generation_config.max_new_tokens is None


@pytest.mark.parametrize("path,error,match", [(None, TypeError, "path must be a str or os.PathLike, not NoneType"),
                                              (b"/tmp", TypeError, "path must be a str or os.PathLike, not bytes"),
                                              ("", ValueError, "path is empty")])
def test_a_path_that_is_no_path_is_one_line_naming_it(path, error, match):
    """None or bytes failed inside pathlib (no argument named); '' loaded the working directory."""
    with pytest.raises(error, match=f"^xlaunch.llm.from_pretrained: {match}"):
        llm.from_pretrained(path)
    if path is not None:        # source=None: no source
        with pytest.raises(error, match=f"^xlaunch.llm.from_pretrained: {match.replace('path', 'source')}"):
            llm.from_pretrained("model.xlp", source=path)


def test_a_checkpoint_path_may_be_relative_a_str_with_a_slash_or_a_link(checkpoints, tmp_path, monkeypatch):
    """Hugging Face's cache: snapshots/<rev>/ holds links into blobs/."""
    snapshot, blobs = tmp_path / "snapshots" / "rev", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for index, file in enumerate(sorted(checkpoints["qwen2"].iterdir())):
        (blobs / f"blob{index}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/blob{index}")
    ids = _ids()
    expected = llm.from_pretrained(checkpoints["qwen2"], dtype=torch.float32)(ids).logits
    monkeypatch.chdir(tmp_path)
    for path in ("snapshots/rev", str(snapshot) + "/", snapshot):
        assert torch.equal(llm.from_pretrained(path, dtype=torch.float32)(ids).logits, expected)


def test_a_missing_or_pre_quantized_weight_is_one_line_before_anything_is_packed(checkpoints, tmp_path, monkeypatch):
    """A tensor missing from the last layer was found after every layer before it was packed (minutes on a large
    model); a GPTQ/AWQ checkpoint (qweight, no weight) or an FP8 one said only "lacks the tensor" or "is F8_E4M3":
    now one line, before any weight is read, naming its quantization_config's method."""
    from safetensors.torch import load_file, save_file

    from xlaunch.llm import loader

    monkeypatch.setattr(loader, "stream_linear", lambda *args, **kwargs: pytest.fail("a weight was packed first"))
    folder = _copy(checkpoints["llama"], tmp_path / "missing")
    tensors = load_file(str(folder / "model.safetensors"))
    last = "model.layers.1.mlp.down_proj.weight"
    save_file({name: t for name, t in tensors.items() if name != last}, str(folder / "model.safetensors"))
    _one_line_error(folder, f"lacks the tensor {last}$")
    for method, change in (("gptq", lambda name, t: {name.replace(".weight", ".qweight"): t.to(torch.int32)}),
                           ("fp8", lambda name, t: {name: t.to(torch.float8_e4m3fn)})):
        folder = _copy(checkpoints["llama"], tmp_path / method)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, "bits": 4}
        (folder / "config.json").write_text(json.dumps(config))
        stored = {}
        for name, t in tensors.items():
            stored.update(change(name, t) if name.endswith("proj.weight") else {name: t})
        save_file(stored, str(folder / "model.safetensors"))
        what = "lacks the tensor .*" if method == "gptq" else "is F8_E4M3, not one of BF16, F16, F32"
        _one_line_error(folder, f"{what} \\(its weights are quantized by {method}: .* weights='int8' or 'int4'\\)")


def test_a_config_file_over_its_bound_is_not_handed_to_transformers(checkpoints, tmp_path):
    """transformers reads config.json and generation_config.json whole: a runaway file (17 MiB here, gigabytes
    in the wild) was read into memory before anything was said."""
    for name in ("config.json", "generation_config.json"):
        folder = _copy(checkpoints["llama"], tmp_path / name)
        with open(folder / name, "r+b") as file:
            file.truncate(17 << 20)
        _one_line_error(folder, f"{name} is {17 << 20} bytes; files over {16 << 20} bytes are not read")
