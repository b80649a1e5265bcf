"""xlaunch.llm.load_decoder: a packed file decoded with torch alone. The same logits and tokens as the Hugging Face
model ``from_pretrained`` makes of the same file (sampling: for the same seed), the checkpoint's generation config
merged as ``generate`` merges it, transformers never imported in a fresh process (and the memory that saves), and
old or malformed files and bad arguments refused with one line."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from native_kernels import without_unbuilt_kernels_warning

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llm_models import VOCAB, prompts, read_manifest, rewrite_manifest, tiny  # noqa: E402

import xlaunch.llm as llm  # noqa: E402
from xlaunch.llm.decoder import RopeTable  # noqa: E402
from xlaunch.llm.packed_file import PackedFileError  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[2]
PRECISIONS = {"fp32": (torch.float32, None), "fp32-int8": (torch.float32, "int8"), "bf16-int4": (torch.bfloat16, "int4")}


@pytest.fixture(scope="module", params=sorted(PRECISIONS))
def both(request, tmp_path_factory):
    """(the packed file's Decoder, the Hugging Face model from_pretrained makes of the same file)."""
    dtype, weights = PRECISIONS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    tiny("llama", seed=4, tie_word_embeddings=request.param == "bf16-int4").save_pretrained(root / "checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)          # bf16 on a CPU without native bf16 says so
        path = llm.save_packed(llm.from_pretrained(root / "checkpoint", dtype=dtype, weights=weights), root / "m.xlp")
        return llm.load_decoder(path), llm.from_pretrained(path)


def hugging_face(model, *args, **kwargs):
    """Hugging Face's own generate (the class's method, not the runtime's loop the instance has)."""
    return type(model).generate(model, *args, **kwargs)


def test_logits_and_a_continued_cache_equal_the_hugging_face_models(both):
    decoder, model = both
    ids, mask = prompts(2, 12, seed=3)
    logits, cache = decoder(ids, attention_mask=mask)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    assert torch.equal(logits, out.logits)
    step = torch.tensor([[11], [12]])
    longer = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    positions = (longer.cumsum(-1) - 1)[:, -1:]
    following, cache = decoder(step, cache, attention_mask=longer, position_ids=positions)
    with torch.no_grad():
        again = model(step, attention_mask=longer, position_ids=positions, past_key_values=out.past_key_values)
    assert torch.equal(following, again.logits) and cache.length == 13
    assert type(cache).__name__ == "KVBuffers" and type(out.past_key_values).__name__ == "KVCache"
    private, _ = llm.load_decoder(decoder.path, private=True)(ids, attention_mask=mask)     # node-local copies
    assert torch.equal(private, logits)


def test_greedy_tokens_with_padding_end_ids_and_a_minimum_equal_generates(both):
    decoder, model = both
    ids, mask = prompts(3, 10, seed=9)
    for call in (dict(max_new_tokens=8), dict(max_new_tokens=8, eos_token_id=[7, 9], pad_token_id=0),
                 dict(max_new_tokens=6, eos_token_id=7, min_new_tokens=4, repetition_penalty=1.4, pad_token_id=0)):
        got = decoder.generate(ids, mask, **call)
        assert torch.equal(got, hugging_face(model, ids, attention_mask=mask, do_sample=False, **call)), call
    one = decoder.generate(ids[:1], max_new_tokens=5)
    assert torch.equal(one, hugging_face(model, ids[:1], max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.7, top_k=0, top_p=0.8), dict(min_p=0.05, top_k=20),
                                      dict(temperature=1.3, repetition_penalty=1.2)])
def test_sampled_tokens_equal_generates_for_the_same_seed(both, sampling):
    decoder, model = both
    ids, mask = prompts(3, 10, seed=5)
    call = dict(max_new_tokens=9, pad_token_id=0, eos_token_id=7, do_sample=True) | sampling
    outputs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        outputs.append(decoder.generate(ids, mask, **call))
        torch.manual_seed(seed)
        assert torch.equal(outputs[-1], hugging_face(model, ids, attention_mask=mask, **call)), (sampling, seed)
    assert not torch.equal(*outputs)        # the tokens really are drawn: another seed, other tokens


def test_the_checkpoints_generation_config_is_merged_as_generate_merges_it(tmp_path):
    """An instruct checkpoint samples by default (do_sample, temperature 0.6, top-p 0.9) and stops at its end id;
    a call's own arguments win; with no length anywhere, 20 new tokens, as generate's default. A field that the
    loop does not apply (beams) is named in one warning at load."""
    source = tiny("llama", seed=6)
    source.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=3, pad_token_id=0)
    source.save_pretrained(tmp_path / "checkpoint")
    path = llm.save_packed(llm.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32), tmp_path / "m.xlp")
    decoder, model = llm.load_decoder(path), llm.from_pretrained(path)
    assert decoder.generation_config["temperature"] == 0.6
    ids, _ = prompts(1, 6, seed=2)
    for call in (dict(max_new_tokens=7), dict(max_new_tokens=7, temperature=1.5, eos_token_id=None), dict()):
        torch.manual_seed(4)
        got = decoder.generate(ids, **call)
        torch.manual_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # generate's note on its default max_length
            assert torch.equal(got, hugging_face(model, ids, **call)), call
    assert decoder.generate(ids, do_sample=False, eos_token_id=None).shape[1] == 6 + 20
    source.generation_config.update(num_beams=2)
    source.save_pretrained(tmp_path / "beams")
    path = llm.save_packed(llm.from_pretrained(tmp_path / "beams", dtype=torch.float32), tmp_path / "beams.xlp")
    with pytest.warns(UserWarning, match=r"sets num_beams=2, which Decoder.generate does not apply") as caught:
        llm.load_decoder(path)
    assert len(caught) == 1


def test_a_streamer_gets_the_prompt_each_token_then_the_end(both):
    decoder, _ = both
    seen, ended = [], []

    class Streamer:
        def put(self, value):
            seen.append(value.flatten().tolist())

        def end(self):
            ended.append(True)

    ids, _ = prompts(1, 4, seed=8)
    out = decoder.generate(ids, max_new_tokens=3, streamer=Streamer())
    assert seen == [ids[0].tolist()] + [[t] for t in out[0, 4:].tolist()] and ended == [True]


@pytest.mark.parametrize("call,option", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(min_new_tokens=-1), "min_new_tokens"),
    (dict(do_sample=True, temperature=0.0), "temperature"), (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(do_sample=True, top_k=-2), "top_k"), (dict(do_sample=True, min_p=2), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(eos_token_id="7"), "eos_token_id"),
    (dict(pad_token_id=-1), "pad_token_id"), (dict(input_ids=torch.ones(1, 3)), "input_ids"),
    (dict(input_ids=torch.tensor([[1, VOCAB]])), "input_ids"), (dict(attention_mask=torch.full((1, 4), 2)), "attention_mask"),
])
def test_bad_arguments_get_one_line_naming_the_option(both, call, option):
    decoder, _ = both
    call = dict(input_ids=torch.tensor([[1, 2, 3, 4]]), max_new_tokens=2) | call
    with pytest.raises(ValueError, match=option) as info:
        decoder.generate(call.pop("input_ids"), **call)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("rope", [None, dict(rope_type="linear", factor=2.0),
                                  dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                       original_max_position_embeddings=64),
                                  dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256)])
def test_the_rope_table_has_the_rotary_modules_values(rope):
    """cos/sin from the recorded inverse frequencies and attention scaling (yarn's is not 1) equal the rotary
    module's own, bit for bit, at every position."""
    model = tiny("llama", seed=1, **({} if rope is None else {"rope_scaling": rope}))
    rotary = model.model.rotary_emb
    positions = torch.arange(700)[None, :]
    cos, sin = rotary(torch.zeros(1, 1, 32), positions)
    table = RopeTable.of(rotary, 32, torch.float32)
    got_cos, got_sin = table.lookup(positions)
    assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)
    if rope and rope["rope_type"] == "yarn":
        assert table.attention_scaling != 1.0


def test_negative_positions_rotate_backwards_as_the_rotary_module_does():
    """A position of -p read the table's row p from its end (another position's angle: a token at a negative
    position got other logits than Hugging Face's); cos(-p), sin(-p) now."""
    model = tiny("llama", seed=1)
    rotary = model.model.rotary_emb
    positions = torch.cat([torch.arange(-300, 0), torch.arange(5)])[None, :]
    cos, sin = rotary(torch.zeros(1, 1, 32), positions)
    got_cos, got_sin = RopeTable.of(rotary, 32, torch.float32).lookup(positions)
    assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)


def test_the_decoders_forward_refuses_inputs_it_cannot_take_in_one_line(both):
    """Decoder(ids) checked nothing: float or 1-D ids failed inside torch's embedding or a reshape, a mask of
    another batch inside the attention kernel."""
    decoder, _ = both
    ids, mask = prompts(2, 6, seed=3)
    for call, option in ((dict(input_ids=ids.float()), "input_ids"), (dict(input_ids=ids[0]), "input_ids"),
                         (dict(attention_mask=mask[:1]), "attention_mask"),
                         (dict(position_ids=torch.arange(3)[None]), "position_ids")):
        call = dict(input_ids=ids) | call
        with pytest.raises(ValueError, match=f"^xlaunch.llm: {option} ") as info:
            decoder(call.pop("input_ids"), **call)
        assert "\n" not in str(info.value)


CHILD = r"""
import json, sys, torch
import xlaunch.llm as llm
load = llm.load_decoder if sys.argv[2] == "standalone" else llm.from_pretrained
model = load(sys.argv[1])
call = dict(max_new_tokens=4, do_sample=False)
ids = torch.tensor([[5, 17, 300, 42]])
out = model.generate(ids, **call)
heavy = [name for name in ("transformers", "torch._dynamo", "torchao") if name in sys.modules]
anon = [int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("Anonymous:")][0]
print(json.dumps(dict(tokens=out[0].tolist(), heavy=heavy, anon_mib=anon // 1024)))
"""


@pytest.mark.parametrize("both", ["bf16-int4"], indirect=True)     # one precision: three interpreters each
def test_a_fresh_process_decodes_without_transformers_and_holds_less(both, tmp_path):
    """Two fresh processes on one file: the standalone one exits 0 with nothing on stderr and never imports
    transformers, torch._dynamo or torchao (the threads test below and the benches' tests start more such
    processes); the one through from_pretrained gives the same tokens and holds at least 40 MiB more anonymous
    memory (about 135 MiB more with this venv's transformers and torchao)."""
    decoder, _ = both
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    runs = {}
    for name in ("standalone", "hugging-face"):
        done = subprocess.run([sys.executable, "-c", CHILD, str(decoder.path), name], capture_output=True, text=True,
                              env=env, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        if name == "standalone":
            assert without_unbuilt_kernels_warning(done.stderr) == ""
        runs[name] = json.loads(done.stdout)
    alone, hugging_face_run = runs["standalone"], runs["hugging-face"]
    assert alone["heavy"] == [] and "transformers" in hugging_face_run["heavy"]
    assert alone["tokens"] == hugging_face_run["tokens"]
    assert hugging_face_run["anon_mib"] - alone["anon_mib"] >= 40, runs


def test_a_file_without_the_decoder_record_is_refused_with_one_line(both, tmp_path):
    """A file written before the decoder's shape was recorded: from_pretrained still loads it, load_decoder says
    how to get one it can load."""
    decoder, model = both
    old = rewrite_manifest(decoder.path, tmp_path / "old.xlp", lambda m: (m.pop("decoder"), m.pop("rope")))
    with pytest.raises(PackedFileError, match="written before packed files recorded") as info:
        llm.load_decoder(old)
    assert "\n" not in str(info.value)
    ids, _ = prompts(1, 5)
    with torch.no_grad():
        assert torch.equal(llm.from_pretrained(old)(ids).logits, model(ids).logits)


def _changed(field: str, value):
    def change(manifest: dict) -> None:
        manifest["decoder"][field] = value
    return change


@pytest.mark.parametrize("change,match", [
    (_changed("num_layers", -1), "decoder shape is malformed"), (_changed("num_layers", 10 ** 9), "malformed"),
    (_changed("architecture", "GPT2LMHeadModel"), "malformed"), (_changed("windows", [None]), "malformed"),
    (_changed("num_kv_heads", 3), "malformed"), (_changed("eps", "tiny"), "malformed"),
    (_changed("rope_type", "dynamic"), "malformed"), (lambda m: m["decoder"].pop("vocab_size"), "malformed"),
    (_changed("intermediate_size", 512), "linear"), (lambda m: m["rope"].update(attention_scaling="x"), "RoPE"),
    (lambda m: m["tensors"]["rope.inv_freq"].update(shape=[3], nbytes=12), "RoPE"),
])
def test_a_malformed_decoder_record_is_one_error(both, tmp_path, change, match):
    decoder, _ = both
    bad = rewrite_manifest(decoder.path, tmp_path / "bad.xlp", change)
    with pytest.raises(PackedFileError, match=match) as info:
        llm.load_decoder(bad)
    assert "\n" not in str(info.value)


def test_rope_frequencies_that_are_not_finite_are_refused(both, tmp_path):
    decoder, _ = both
    entry = read_manifest(decoder.path)["tensors"]["rope.inv_freq"]
    data = bytearray(decoder.path.read_bytes())
    data[entry["offset"]:entry["offset"] + 4] = struct.pack("<f", float("nan"))
    (tmp_path / "nan.xlp").write_bytes(bytes(data))
    with pytest.raises(PackedFileError, match="not finite"):
        llm.load_decoder(tmp_path / "nan.xlp")


def test_from_pretrained_refuses_a_record_that_is_not_its_configs(both, tmp_path):
    decoder, _ = both
    other = rewrite_manifest(decoder.path, tmp_path / "other.xlp", _changed("eps", 0.5))
    with pytest.raises(PackedFileError, match="not its config's"):
        llm.from_pretrained(other)
    assert read_manifest(decoder.path)["decoder"]["num_layers"] == decoder.spec.num_layers


def test_the_record_is_plain_json_of_the_spec(both):
    decoder, _ = both
    record = read_manifest(decoder.path)["decoder"]
    assert json.loads(json.dumps(record)) == record and record["windows"] == [None] * decoder.spec.num_layers
    assert "Decoder(m.xlp: LlamaForCausalLM, 2 layers" in repr(decoder)


THREADS_CHILD = r"""
import sys, threading, torch
import xlaunch.llm as llm
torch.set_num_threads(1)
decoder = llm.load_decoder(sys.argv[1])
prompts = [torch.randint(1, 500, (1, 300 + 40 * i), generator=torch.Generator().manual_seed(i)) for i in range(4)]
alone = [decoder.generate(p, max_new_tokens=3) for p in prompts]
for trial in range(3):
    fresh = llm.load_decoder(sys.argv[1])          # its RoPE table starts empty: the threads grow it together
    got = [None] * len(prompts)
    def run(i):
        got[i] = fresh.generate(prompts[i], max_new_tokens=3)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads: t.start()
    for t in threads: t.join()
    assert all(g is not None and torch.equal(g, a) for g, a in zip(got, alone)), trial
print("ok")
"""


@pytest.mark.parametrize("both", ["fp32-int8"], indirect=True)
def test_threads_sharing_one_decoder_get_the_tokens_each_gets_alone(both):
    """Four threads decode different prompts with one Decoder at once, growing its RoPE table past 256 positions
    together; each gets the tokens it gets alone (a fresh process, exit 0, nothing on stderr)."""
    decoder, _ = both
    done = subprocess.run([sys.executable, "-c", THREADS_CHILD, str(decoder.path)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), timeout=240)
    assert (done.returncode, done.stdout.strip(), without_unbuilt_kernels_warning(done.stderr)) == (0, "ok", "")


@pytest.mark.parametrize("both", ["fp32-int8"], indirect=True)
def test_node_copy_maps_this_nodes_copy_of_the_file(both, monkeypatch):
    """On a recorded 2-socket Xeon (XLAUNCH_FSROOT), load_decoder(node_copy=True) maps the copy of the node this
    process's CPUs lie in, written beside the file, with the same logits; on a 1-node machine, the file."""
    from machine_trees import machine_tree

    from xlaunch.machine import clear_cache

    decoder, _ = both
    ids, _ = prompts(1, 6, seed=1)
    here = llm.load_decoder(decoder.path, node_copy=True)
    assert here.mapped == decoder.path or here.mapped.name.startswith(".m.xlp.node")    # this VM: one node or not
    monkeypatch.setenv("XLAUNCH_FSROOT", str(machine_tree("xeon-2s-amx")))
    clear_cache()
    try:
        copied = llm.load_decoder(decoder.path, node_copy=True)
        model = llm.from_pretrained(decoder.path, node_copy=True)
    finally:
        clear_cache()
    if copied.mapped == decoder.path:
        pytest.skip("this process's CPUs span the recorded machine's nodes")
    assert copied.mapped.parent == decoder.path.parent and copied.mapped.name.startswith(".m.xlp.node")
    assert torch.equal(copied(ids)[0], decoder(ids)[0])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, decoder(ids)[0])
