"""xlaunch.llm.shapes and footprint: the presets are the published models (transformers builds them, with the
published parameter counts), a written random checkpoint loads as transformers' own, the memory estimate of the
packed weights matches what from_pretrained holds, and examples/llm.py refuses a shape that does not fit and runs
a user's checkpoint (--model). Every model built here is a few MB at most (the big presets only on the meta device)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llm_models import tiny  # noqa: E402

from xlaunch.llm import footprint, shapes  # noqa: E402

pytestmark = [pytest.mark.torch]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "llm.py")
# the sizes the model cards publish (billions of parameters)
PUBLISHED = {"llama-3.2-1b": 1.23, "llama-3.2-3b": 3.21, "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54,
             "mistral-7b-v0.1": 7.24}


def hf_config(config: dict):
    kwargs = {key: value for key, value in config.items() if key not in ("architectures", "model_type")}
    return transformers.AutoConfig.for_model(config["model_type"], **kwargs)


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_build_the_published_models(name):
    config = shapes.preset(name)
    hf = hf_config(config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert type(model).__name__ == config["architectures"][0]
    counted = sum(p.numel() for p in model.parameters())
    shape = shapes.Shape(config)
    assert shape.parameters() == counted
    assert abs(counted / (PUBLISHED[name] * 1e9) - 1) < 0.02, counted
    # the written checkpoint's tensors are the model's state dict, shape for shape
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    if shape.tied:
        expected.pop("lm_head.weight")
    assert {n: dims for n, dims, _ in shape.tensors()} == expected
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.out_features == hf.num_key_value_heads * attention.head_dim
    assert (attention.q_proj.bias is not None) == (config["model_type"] == "qwen2")
    rope = hf.rope_parameters
    assert rope["rope_theta"] == config["rope_theta"]
    assert rope["rope_type"] == ("llama3" if name.startswith("llama") else "default")


def test_bad_names_list_the_presets():
    with pytest.raises(shapes.ShapeError, match="presets: llama-168m, tiny, llama-3.2-1b"):
        shapes.preset("llama-4")


def test_a_checkpoints_config_is_read_bounded_and_checked(tmp_path):
    """--model's config.json: a regular file of at most 1 MiB holding a JSON object with a decoder's
    sizes; anything else is one ShapeError naming the file (a FIFO is refused without being opened)."""
    config = tmp_path / "config.json"
    for make, words in ((lambda: os.mkfifo(config), "is a FIFO, not a regular file"),
                        (lambda: config.write_text(" " * (1 << 20) + "{}"), "files over 1048576 bytes are not read"),
                        (lambda: config.write_text("[1, 2]"), "holds no JSON object"),
                        (lambda: config.write_text("{nope"), "cannot read"),
                        (lambda: config.write_text("{}"), "lacks hidden_size")):
        config.unlink(missing_ok=True)
        make()
        with pytest.raises(shapes.ShapeError, match=words) as info:
            shapes.read_config(tmp_path)
        assert str(info.value).startswith("--model: ") and str(config) in str(info.value)
        assert "\n" not in str(info.value)
    config.unlink()
    config.write_text(json.dumps(shapes.preset("tiny")))
    assert shapes.read_config(tmp_path)["hidden_size"] == shapes.preset("tiny")["hidden_size"]


def test_written_checkpoint_loads_as_transformers_model(tmp_path, monkeypatch):
    # a Qwen2 (biases) scaled down from the 0.5B preset, written in slices of 16 KiB
    config = dict(shapes.preset("qwen2.5-0.5b"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    monkeypatch.setattr(shapes, "CHUNK_BYTES", 16 << 10)
    folder = shapes.write_checkpoint(tmp_path / "qwen", config, seed=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen"]          # no partial folder left
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16 and type(model).__name__ == "Qwen2ForCausalLM"
    layer = model.model.layers[1]
    assert abs(float(layer.mlp.up_proj.weight.detach().float().std()) - 0.02) < 0.002
    assert torch.equal(layer.input_layernorm.weight.float(), torch.ones(64))
    assert not layer.self_attn.k_proj.bias.any()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()    # tied
    again = shapes.write_checkpoint(tmp_path / "again", config, seed=3)
    other = shapes.write_checkpoint(tmp_path / "other", config, seed=4)
    data = (folder / "model.safetensors").read_bytes()
    assert data == (again / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert len(data) - 8 - int.from_bytes(data[:8], "little") == shapes.checkpoint_bytes(config)


@pytest.mark.parametrize("dtype,weights,checkpoint,tied", [("fp32", None, "fp32", False), ("bf16", None, "fp32", False),
                                                           ("fp32", "int8", "fp32", False), ("bf16", "int4", "fp32", False),
                                                           ("fp32", "int8", "bf16", False), ("fp32", "int4", "bf16", True)])
def test_packed_estimate_is_what_from_pretrained_holds(tmp_path, dtype, weights, checkpoint, tied):
    import xlaunch.llm as llm

    model = tiny("qwen2", seed=2, tie_word_embeddings=tied).to({"fp32": torch.float32, "bf16": torch.bfloat16}[checkpoint])
    model.save_pretrained(tmp_path)
    loaded = llm.from_pretrained(tmp_path, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                                 weights=weights, group_size=32)
    named = [*loaded.named_parameters(), *loaded.named_buffers()]
    held = {t.data_ptr(): t.numel() * t.element_size() for name, t in named if "rotary_emb" not in name}
    shape = shapes.Shape(json.loads((tmp_path / "config.json").read_text()))
    from xlaunch.llm import native

    kernels = native.available()               # without them (no compiler) INT4 takes ATen's layout
    assert footprint.packed_bytes(shape, dtype, weights, group_size=32, kernels=kernels) == sum(held.values())


def test_the_int4_routes_lm_head_is_6_bit_where_the_kernels_run_it():
    """INT6 in groups of 64 under INT4 layers (Q6_K's place in llama.cpp's Q4_0 files); INT8 without the kernels
    or when the inputs are no multiple of 64; every other precision keeps its own kind."""
    assert footprint.lm_head_kind("int4", 2048) == "int6"
    assert footprint.lm_head_kind("int4", 2048, kernels=False) == "int8"
    assert footprint.lm_head_kind("int4", 2080) == "int8"
    assert [footprint.lm_head_kind(kind, 2048) for kind in ("int8", "bf16", "fp32")] == ["int8", "bf16", "fp32"]
    shape = shapes.Shape(shapes.preset("llama-3.2-1b"))
    six = footprint.packed_linear_bytes(shape.vocab, shape.hidden, "int6", 64)
    eight = footprint.packed_linear_bytes(shape.vocab, shape.hidden, "int8")
    assert 0.8 < six / eight < 0.83        # 6.5 bits a value against 8 (and a scale per channel)


def test_kv_cache_and_activation_formulas_by_hand():
    shape = shapes.Shape(shapes.preset("tiny"))      # 2 layers, 2 KV heads of 32, vocabulary 512
    assert footprint.kv_cache_bytes(shape, 100, 3, "bf16") == 2 * 2 * 2 * 32 * 100 * 3 * 2
    assert footprint.activation_bytes(shape, 10) == 4 * 10 * (512 + 2 * 256 + (4 + 4) * 32 + 4 * 128)
    assert footprint.packed_linear_bytes(96, 256, "int4", 128) == 128 * 256 // 2 + 4 * 128 * 2   # padded to 128
    assert footprint.packed_linear_bytes(96, 256, "int6", 64) == 128 * 256 * 3 // 4 + 4 * 128 * 4
    assert footprint.packed_linear_bytes(4096, 4096, "bf16") == 32 << 20                          # 2 MiB pages
    assert footprint.packed_linear_bytes(4097, 1024, "int8") == (6 << 20) + 4 * 4160


def test_refusal_names_the_shape_the_need_and_what_is_there(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 8000000 kB\nMemFree: 1 kB\nMemAvailable: 1048576 kB\n")
    from xlaunch.machine import memory_available

    assert memory_available(str(tmp_path)) == 1 << 30
    line = footprint.refusal("x", "big", footprint.Need(3 << 30, "the weights"), root=str(tmp_path))
    assert line == ("x: shape big needs about 3.0 GiB of memory (the weights), this machine has 1.0 GiB "
                    "available (MemAvailable); nothing was started")
    assert footprint.refusal("x", "small", footprint.Need(1 << 29, "w"), root=str(tmp_path)) is None
    disk = footprint.refusal("x", "small", footprint.Need(1 << 29, "w", 1 << 60, str(tmp_path / "no" / "dir")),
                             root=str(tmp_path))
    assert disk.startswith("x: shape small needs 1073741824.0 GiB of disk under ") and "\n" not in disk


def test_the_widening_buffer_is_counted_only_where_the_kernel_choice_measures(monkeypatch):
    """Llama-3.2-1B: gate/up (2 x 8192 x 2048, 64 MiB in bf16) and the 128k lm_head (501 MiB) are widened
    32 MiB at a time (8192 channels of 2048); Qwen2.5-0.5B's 151936 x 896 lm_head in slices of 18688
    channels (whole blocks of 64 under 32 MiB)."""
    shape = shapes.Shape(shapes.preset("llama-3.2-1b"))
    monkeypatch.setattr(footprint, "native_bf16", lambda: True)
    assert footprint.widening_buffer_bytes(shape, "bf16") == 32 << 20
    assert footprint.widened_slice_channels(16384, 2048, 2) == 8192
    assert footprint.widened_slice_channels(128256, 2048, 2) == 8192
    assert footprint.widened_slice_channels(1000, 10 << 20, 2) == 64      # one block, whatever its size
    small = shapes.Shape(shapes.preset("qwen2.5-0.5b"))
    assert footprint.widening_buffer_bytes(small, "bf16") == 18688 * 896 * 2
    assert footprint.widening_buffer_bytes(shape, "fp32") == 0
    monkeypatch.setattr(footprint, "native_bf16", lambda: False)
    assert footprint.widening_buffer_bytes(shape, "bf16") == 0


def test_default_activations_follow_the_same_flags_as_optimize():
    from xlaunch.llm import api

    assert footprint.BF16_FLAGS == api.BF16_FLAGS
    assert footprint.default_activations() == {torch.bfloat16: "bf16", torch.float32: "fp32"}[api.default_dtype()]


@pytest.mark.parametrize("cap, native", [("", True), ("avx2", False), ("avx512", False), ("avx512_vnni", False),
                                          ("avx512_bf16", True), ("amx", True)])
def test_native_bf16_follows_the_kernels_cap(recorded_machine, monkeypatch, cap, native):
    """On a recorded AMX Xeon: capped below ``avx512_bf16``, the kernels widen bf16 as on an AVX2 CPU, so bf16
    is not native there and the defaults (fp32 activations, no widening buffer) follow the cap."""
    from xlaunch.machine import clear_cache

    monkeypatch.setenv("XLAUNCH_FSROOT", str(recorded_machine("xeon-2s-amx")))
    monkeypatch.setenv("XLAUNCH_CPU_ISA", cap)
    clear_cache()
    try:
        assert footprint.native_bf16() is native
        assert footprint.default_activations() == ("bf16" if native else "fp32")
        shape = shapes.Shape(shapes.preset("llama-3.2-1b"))
        assert (footprint.widening_buffer_bytes(shape, "bf16") > 0) is native
    finally:
        clear_cache()


@pytest.mark.live
def test_example_refuses_a_shape_too_big_for_the_memory(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 262144 kB\n")
    env = dict(os.environ, XLAUNCH_FSROOT=str(tmp_path), XLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, EXAMPLE, "--shape", "llama-3.2-1b", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("examples/llm.py: shape llama-3.2-1b needs about ")
    assert "0.2 GiB available (MemAvailable)" in proc.stderr
    assert not (tmp_path / "cache").exists()
    bad = subprocess.run([sys.executable, EXAMPLE, "--shape", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "presets: llama-168m" in bad.stderr
