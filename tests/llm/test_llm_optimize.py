"""xlaunch.llm.optimize on tiny random Llama, Mistral and Qwen2 models: accuracy teacher-forced
against the reference route of each precision, generate with and without it, batches, prompts of
1 and 100 tokens, the preallocated cache, unknown architectures and the pure-torch fallback."""
from __future__ import annotations

import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llm_models import VOCAB, clone, prompts, relative_error, tiny  # noqa: E402

import xlaunch.llm as llm  # noqa: E402
from xlaunch.llm import native  # noqa: E402
from xlaunch.llm.cache import KVCache  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]   # see conftest: 2 threads crawl under load
TEACHER_TOKENS = 80


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


@pytest.fixture(scope="module")
def teacher(llama):
    ids = torch.randint(1, VOCAB, (1, TEACHER_TOKENS), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return ids, llama(ids).logits


def test_bf16_logits_within_1_5x_of_hugging_face_bf16(llama, teacher):
    ids, fp32 = teacher
    reference = clone(llama).to(torch.bfloat16)
    with torch.no_grad():
        reference_error = relative_error(reference(ids).logits, fp32)
    ours = llm.optimize(clone(llama), dtype=torch.bfloat16)
    error = relative_error(ours(ids).logits, fp32)
    assert 0 < error <= 1.5 * reference_error, (error, reference_error)


def test_int8_logits_within_1_5x_of_torchao_int8_weight_only(llama, teacher):
    quant_api = pytest.importorskip("torchao.quantization")
    ids, fp32 = teacher
    reference = clone(llama).to(torch.bfloat16)
    quant_api.quantize_(reference, quant_api.Int8WeightOnlyConfig())
    with torch.no_grad():
        reference_error = relative_error(reference(ids).logits, fp32)
    ours = llm.optimize(clone(llama), dtype=torch.bfloat16, weights="int8")
    error = relative_error(ours(ids).logits, fp32)
    assert 0 < error <= 1.5 * reference_error, (error, reference_error)


def test_int4_logits_stay_near_fp32(llama, teacher):
    ids, fp32 = teacher
    for group in (32, 128):
        ours = llm.optimize(clone(llama), dtype=torch.bfloat16, weights="int4", group_size=group)
        assert relative_error(ours(ids).logits, fp32) < 0.35


@pytest.mark.parametrize("architecture,batch,length", [
    ("llama", 1, 1), ("llama", 1, 100), ("llama", 4, 1), ("llama", 4, 100),
    ("mistral", 4, 100),     # a sliding window of 48 slots: prefill and decode beyond it
    ("qwen2", 4, 100),       # q/k/v biases
])
def test_generate_matches_hugging_face_in_fp32(architecture, batch, length):
    overrides = {"sliding_window": 48} if architecture == "mistral" else {}
    model = tiny(architecture, **overrides)
    ids, mask = prompts(batch, length)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    optimized = llm.optimize(clone(model), dtype=torch.float32)
    got = optimized.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.shape == (batch, length + 12)
    assert torch.equal(got, expected)


def test_generate_returns_the_same_model_and_fills_a_preallocated_cache(llama):
    model = clone(llama)
    assert llm.optimize(model) is model   # in the CPU's default dtype
    ids, mask = prompts(4, 9)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, KVCache)
    assert out.sequences.shape == (4, 15)
    assert cache.capacity == cache.length == 14      # generate's maximum: the last token is never fed back
    assert cache.keys[0].dtype == llm.default_dtype() and cache.keys[0].shape == (4, 2, 14, 32)


def test_decoding_never_reallocates_the_cache(llama):
    model = llm.optimize(clone(llama), dtype=torch.float32)
    ids = torch.randint(1, VOCAB, (1, 5))
    out = model(ids)
    cache = out.past_key_values
    cache.reserve(1, 40)
    addresses = [tensor.data_ptr() for tensor in cache.keys + cache.values]
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(30):
        out = model(token, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
    assert cache.length == 35
    assert [tensor.data_ptr() for tensor in cache.keys + cache.values] == addresses


def test_incremental_calls_equal_one_call(llama):
    model = llm.optimize(clone(llama), dtype=torch.float32)
    ids = torch.randint(1, VOCAB, (2, 30))
    whole = model(ids).logits
    first = model(ids[:, :17])
    rest = model(ids[:, 17:], past_key_values=first.past_key_values)
    assert torch.allclose(torch.cat([first.logits, rest.logits], dim=1), whole, atol=1e-5)
    assert model(ids, use_cache=False).past_key_values is None


def test_an_unknown_architecture_warns_and_comes_back_unchanged():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128)).eval()
    forward = model.forward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert llm.optimize(model) is model
    assert [str(w.message) for w in caught] == [
        "xlaunch.llm.optimize: GPT2LMHeadModel is not a supported architecture "
        "(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM); the model is returned unchanged"]
    assert model.forward == forward and isinstance(model.transformer.h[0].attn.c_attn, torch.nn.Module)


def test_a_group_size_that_is_no_integer_is_one_value_error_before_anything_is_packed(llama):
    """group_size=64.0 passed the check (64.0 == 64) and failed inside a reshape, the first layer half-packed."""
    model = clone(llama)
    with pytest.raises(ValueError, match=r"^xlaunch.llm.optimize: group_size must be one of \(32, 64, 128\), not 64.0$"):
        llm.optimize(model, weights="int4", group_size=64.0)
    assert not llm.is_optimized(model) and isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


def test_optimizing_again_for_another_precision_says_the_model_keeps_its_own(llama):
    """optimize(optimized, dtype=bf16, weights='int4') returned the fp32 model unchanged, without a word: the caller
    believed it had INT4. The same precision again stays quiet."""
    model = llm.optimize(clone(llama), dtype=torch.float32, weights="int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert llm.optimize(model, dtype=torch.float32, weights="int8") is model
        assert caught == []
        assert llm.optimize(model, dtype=torch.float32, weights="int4", group_size=32) is model
    assert [(str(w.message), w.filename) for w in caught] == [(
        "xlaunch.llm.optimize: the model is already optimized (float32, weights int8) and is returned as it is, not "
        "as float32, weights int4, group_size 32; optimize the original model for that", __file__)]
    assert model.lm_head.kind == "int8"


def _runtime_dtype(model):
    return model._xlaunch_llm.dtype


def test_a_16_bit_embedding_stays_16_bit_under_fp32_activations_with_the_same_logits(llama, monkeypatch):
    """Half the embedding's memory and nothing else changed: the rows a step looks up widen to the fp32
    values they were. ``model.dtype`` stays fp32 (the table is a buffer); a table that is not exactly
    16-bit stays fp32."""
    from xlaunch.llm import api

    exact = clone(llama)
    with torch.no_grad():
        exact.model.embed_tokens.weight.copy_(exact.model.embed_tokens.weight.to(torch.bfloat16).float())
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    ours = llm.optimize(clone(exact), dtype=torch.float32, weights="int8")
    table = ours.model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and ours.dtype == torch.float32
    assert all(parameter is not table for parameter in ours.parameters())
    with torch.no_grad():
        assert torch.equal(ours.model.embed_tokens(ids), exact.model.embed_tokens(ids))
    monkeypatch.setattr(api, "embedding_table", lambda t, dtype: t.detach().to(dtype))
    wide = llm.optimize(clone(exact), dtype=torch.float32, weights="int8")
    assert wide.model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, wide(ids).logits)
    assert torch.equal(ours.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
                       wide.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    monkeypatch.undo()
    assert llm.optimize(clone(llama), dtype=torch.float32).model.embed_tokens.weight.dtype == torch.float32
    half = llm.optimize(clone(exact).to(torch.bfloat16), dtype=torch.bfloat16)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16 and half.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_device_and_dtype_come_from_the_first_module(llama, dtype):
    """Hugging Face answers ``model.device`` and ``model.dtype`` from the first parameter, and ``generate``
    asks for ``device`` twice a token: the model's first parameter is the embedding's (empty, in the
    activations' dtype), three modules in, not the first layer's norm after every retired projection."""
    model = llm.optimize(clone(llama).to(torch.bfloat16), dtype=dtype, weights="int8")
    name, first = next(iter(model.named_parameters()))
    owner = name.rpartition(".")[0]
    assert name == "model.embed_tokens.activations"
    assert [module for module, _ in model.named_modules()].index(owner) == 2    # the third module visited
    assert first.numel() == 0 and first.dtype == dtype and not first.requires_grad
    assert model.dtype == dtype and model.device == torch.device("cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16       # the table: 16-bit, a buffer
    assert next(model.parameters()) is first


@pytest.mark.parametrize("dtype,weights", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8"),
                                           (torch.float32, "int4")])
def test_a_tied_embedding_is_read_from_the_packed_lm_head(dtype, weights):
    """One copy of a tied matrix: no embedding table is left in the model; the rows a step looks up are the
    packed lm_head's (the weights themselves in fp32/bf16; INT8 rows, within 1% of them, under int8; INT6 rows
    in groups of 64, within 2%, under int4 where the kernels run)."""
    hf = tiny("llama", seed=6, tie_word_embeddings=True, vocab_size=2048)    # the largest matrix by far
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf.model.embed_tokens(ids).to(dtype)
    model = llm.optimize(clone(hf), dtype=dtype, weights=weights)
    embedding = model.model.embed_tokens
    assert embedding.weight is None and embedding.lm_head is model.lm_head and model.dtype == dtype
    held = [*model.parameters(), *model.buffers()]
    packed_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()   # a copy in any dtype: as large
    matrices = {t.data_ptr() for t in held if t.numel() * t.element_size() >= packed_bytes}
    assert matrices == {model.lm_head.weight.data_ptr()}         # the vocabulary's matrix is held once
    with torch.no_grad():
        rows = embedding(ids)
        assert rows.dtype == dtype and torch.equal(rows, model.lm_head.dense_weight()[ids].to(dtype))
        if weights is None:
            assert torch.equal(rows, expected)
        else:
            assert relative_error(rows, expected) < (0.02 if model.lm_head.kind == "int6" else 0.01)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14)


@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_a_token_id_outside_the_vocabulary_is_one_error_tied_or_not(weights):
    """A tied embedding's rows come from the packed lm_head: id -1 read the last token's row (no error) and an id
    past the vocabulary failed inside the layout's indexing ("index 8 is out of bounds for dimension 0 with size
    8"). Either is now one line naming the id, tied or not, in forward and generate."""
    for tied in (True, False):
        model = llm.optimize(tiny("llama", seed=2, tie_word_embeddings=tied), dtype=torch.float32, weights=weights)
        for bad in (-1, VOCAB, 10 ** 6):
            ids = torch.tensor([[3, bad, 5]])
            message = f"input_ids holds token id {bad}, outside the vocabulary \\(0 to {VOCAB - 1}\\)"
            with pytest.raises(IndexError, match=message):
                model(ids)
            with pytest.raises(ValueError, match=message):
                model.generate(ids, max_new_tokens=2, pad_token_id=0)


@pytest.mark.parametrize("dtype,weights,checkpoint", [
    (torch.float32, None, torch.float32), (torch.float32, None, torch.bfloat16), (torch.bfloat16, None, torch.float32),
    (torch.float32, "int8", torch.float32), (torch.bfloat16, "int4", torch.float32)])
def test_a_dtype_conversion_after_optimize_is_refused_or_changes_nothing(llama, dtype, weights, checkpoint):
    """``.to(other dtype)``, ``.half()``, ``.to("meta")``... cast the packed weights under the runtime (a failure
    inside a kernel, or ``model.dtype`` bf16 while fp32 ran): one ValueError now, nothing changed. A conversion to
    the dtype it computes in (``.float()`` of an fp32 model, whose bf16 checkpoint's weights stay bf16) is a no-op."""
    hf = clone(llama).to(checkpoint).float()      # a bf16 checkpoint: fp32 weights holding bf16 values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)          # bf16 on a CPU without native bf16 says so
        model = llm.optimize(hf, dtype=dtype, weights=weights)
    ids, mask = prompts(2, 8)
    expected = model(ids, attention_mask=mask).logits
    held = {key: (value.dtype, value.data_ptr()) for key, value in model.state_dict().items()}
    name = str(dtype).replace("torch.", "")
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for convert in (lambda m: m.to(other), lambda m: m.half(), lambda m: m.double(), lambda m: m.to("meta"),
                    lambda m: m.to("cpu", other), lambda m: m.float() if dtype == torch.bfloat16 else m.bfloat16()):
        with pytest.raises(ValueError, match=f"computes in {name} on the CPU with packed weights and cannot be conv"):
            convert(model)
    assert model.to(dtype) is model and model.cpu() is model and model.to("cpu", dtype) is model
    assert (model.float() if dtype == torch.float32 else model.bfloat16()) is model
    assert {key: (value.dtype, value.data_ptr()) for key, value in model.state_dict().items()} == held
    assert model.dtype == dtype and torch.equal(model(ids, attention_mask=mask).logits, expected)


@pytest.mark.parametrize("dtype,weights,tied", [(torch.float32, None, False), (torch.bfloat16, "int4", True)])
def test_a_deep_copy_and_a_pickled_copy_run_their_own_runtime(dtype, weights, tied, tmp_path):
    """copy.deepcopy and torch.save of a model that had run failed ("cannot pickle '_OpNamespace' object": the
    runtime's bound kernels), and a copy made before it ran read the original's configs (the installed forward and
    generate held the original model and runtime). Each copy now runs its own, with the original's tokens."""
    import copy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)          # bf16 on a CPU without native bf16 says so
        model = llm.optimize(tiny("llama", seed=5, tie_word_embeddings=tied), dtype=dtype, weights=weights)
    ids, mask = prompts(2, 8)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    twin = copy.deepcopy(model)
    twin.generation_config.max_new_tokens = 3
    assert twin.generate(ids, attention_mask=mask, pad_token_id=0).shape == (2, 11)
    twin.config.use_cache = False
    assert twin(ids).past_key_values is None and model(ids).past_key_values is not None
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for copied in (twin, loaded):
        runtime = getattr(copied, "_xlaunch_llm")
        assert runtime is not getattr(model, "_xlaunch_llm") and runtime.layers[0].qkv is copied.model.layers[0].self_attn.qkv_proj
        assert torch.equal(copied.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0), expected)


def test_save_pretrained_of_an_optimized_model_is_one_error(llama, tmp_path):
    """It wrote the packed tensors under names transformers does not load: the reloaded model's q/k/v and gate/up
    were newly initialized (random tokens, a load report the only sign)."""
    model = llm.optimize(clone(llama), dtype=torch.float32, weights="int8")
    with pytest.raises(ValueError, match="save_pretrained of an optimized model .* xlaunch.llm.save_packed"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16-cpu", "avx2-cpu"])
def test_the_default_dtype_follows_the_cpu(llama, monkeypatch, native_bf16):
    """A faked ISA: bf16 activations by default only where the CPU has native bf16; no warning either way."""
    from xlaunch.llm import api

    monkeypatch.setattr(api, "native_bf16", lambda: native_bf16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = llm.optimize(clone(llama), weights="int8")
    assert caught == []
    expected = torch.bfloat16 if native_bf16 else torch.float32
    assert llm.default_dtype() == expected and _runtime_dtype(model) == expected
    assert model.model.embed_tokens.weight.dtype == expected and model.lm_head.dtype == expected


def test_bf16_on_a_cpu_without_native_bf16_warns_once_and_runs_bf16(llama, monkeypatch):
    from xlaunch.llm import api

    monkeypatch.setattr(api, "native_bf16", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = llm.optimize(clone(llama), dtype=torch.bfloat16); line = sys._getframe().f_lineno   # noqa: E702
    assert [w.category for w in caught] == [UserWarning]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)     # the caller's line (was its caller's)
    assert "neither AVX512_BF16 nor AMX_BF16" in str(caught[0].message) and "torch.float32" in str(caught[0].message)
    assert _runtime_dtype(model) == torch.bfloat16
    monkeypatch.setattr(api, "native_bf16", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.optimize(clone(llama), dtype=torch.bfloat16)
    assert caught == []


def test_native_bf16_reads_this_cpus_flags(monkeypatch):
    """Uncapped (test_llm_shapes checks the cap on a recorded machine)."""
    from xlaunch.llm import api
    from xlaunch.machine import current_machine

    monkeypatch.delenv("XLAUNCH_CPU_ISA", raising=False)

    flags = current_machine().isa.flags
    assert api.native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_bad_arguments_name_the_option(llama):
    with pytest.raises(ValueError, match="dtype must be"):
        llm.optimize(clone(llama), dtype=torch.float16)
    with pytest.raises(ValueError, match="weights must be"):
        llm.optimize(clone(llama), weights="int2")
    with pytest.raises(ValueError, match="group_size must be"):
        llm.optimize(clone(llama), weights="int4", group_size=48)


@pytest.mark.parametrize("sizes,hint", [(dict(intermediate_size=200), "use weights='int8'"),
                                        (dict(hidden_size=192, intermediate_size=384), "group_size=32 or 64 fits")])
def test_an_int4_group_size_that_does_not_divide_a_layer_is_one_error_and_changes_nothing(sizes, hint):
    """The first layer's down_proj (200 inputs) failed to pack after q/k/v, o and gate/up were replaced: a ValueError
    from the quantizer naming no option, and a model whose first layer raised on every call."""
    model = tiny("llama", **sizes)
    ids = torch.tensor([[1, 2, 3]])
    before = model(ids).logits
    with pytest.raises(ValueError, match=rf"^xlaunch.llm.optimize: group_size 128 does not divide .*; {hint}"):
        llm.optimize(model, weights="int4")
    assert not llm.api.is_optimized(model)
    assert torch.equal(model(ids).logits, before)


def test_a_foreign_cache_with_tokens_is_refused(llama):
    from transformers import DynamicCache

    plain = clone(llama)
    ids = torch.randint(1, VOCAB, (1, 6))
    with torch.no_grad():
        foreign = plain(ids, use_cache=True).past_key_values
    assert isinstance(foreign, DynamicCache) and foreign.get_seq_length() == 6
    model = llm.optimize(clone(llama), dtype=torch.float32)
    with pytest.raises(ValueError, match="holding tokens"):
        model(ids[:, -1:], past_key_values=foreign)
    assert model(ids, past_key_values=DynamicCache()).past_key_values.length == 6   # an empty one is fine


@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_the_pure_torch_fallback_gives_the_kernels_results(llama, teacher, weights):
    """Both fallbacks: a model packed without the kernels (ATen's layouts and operators, what a
    machine without a compiler gets), and a kernel-packed model run with the kernels switched off."""
    ids, _ = teacher
    with native.prefer_native(False):
        aten = llm.optimize(clone(llama), dtype=torch.bfloat16, weights=weights, group_size=32)
        assert aten.lm_head.layout == "aten"
        aten_logits = aten(ids).logits.float()
    model = llm.optimize(clone(llama), dtype=torch.bfloat16, weights=weights, group_size=32)
    with native.prefer_native(False):
        switched_off = model(ids).logits.float()
    kernels = model(ids).logits.float()
    if native.ops() is not None:
        assert model.lm_head.layout == "native"
    # under int4 the kernels' lm_head is INT6 (groups of 64), the ATen fallback's INT8: they differ by that rounding
    six = weights == "int4" and native.ops() is not None
    assert aten.lm_head.kind == ("int8" if weights == "int4" else weights or "bf16")
    assert model.lm_head.kind == ("int6" if six else aten.lm_head.kind)
    assert relative_error(kernels, aten_logits) < (5e-2 if six else 2e-2)
    assert relative_error(kernels, switched_off) < 2e-2


def test_without_transformers_the_message_names_the_extra(tmp_path):
    import subprocess
    import sys

    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n")
    code = ("import xlaunch.llm as llm\n"
            "try:\n    llm.optimize\nexcept ImportError as exc:\n    print(exc.name, '|', exc)\n"
            "import sys\nprint('torchao imported:', 'torchao' in sys.modules)\n")   # seconds of import, for nothing
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == ['transformers | xlaunch.llm needs transformers: pip install "xlaunch[llm]"',
                                                 "torchao imported: False"]


@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_a_long_prompts_mlp_in_row_chunks_gives_the_same_logits(llama, monkeypatch, weights):
    """decoder.MLP_ROWS rows of the MLP at a time (here 7, so 2 x 30 rows take 9 chunks, the last short):
    every row is computed on its own, so the logits are those of one pass, bit for bit. (fp32 weights: the
    last chunk's 4 rows take the kernels' fp32_linear, the whole pass ATen's GEMM: equal within fp32 rounding.)"""
    from xlaunch.llm import decoder

    monkeypatch.setenv("XLAUNCH_LLM_DENSE_ROWS", "off")
    model = llm.optimize(clone(llama), dtype=torch.float32, weights=weights)
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    whole = model(ids).logits
    chunks = []
    mlp = decoder._mlp

    def counted(x, gate_up, silu_mul, down):
        return mlp(x, lambda rows: chunks.append(rows.shape[0]) or gate_up(rows), silu_mul, down)

    monkeypatch.setattr(decoder, "MLP_ROWS", 7)
    monkeypatch.setattr(decoder, "_mlp", counted)
    chunked = model(ids).logits
    if weights is None:
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(chunked, whole)
    layers = len(llama.model.layers)
    assert chunks == ([7] * 8 + [4]) * layers
