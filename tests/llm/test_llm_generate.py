"""``generate`` of an optimized model: one-beam greedy and plain sampling calls run xlaunch.llm's own loop
(``DecoderRuntime.generate_tokens``) and give Hugging Face's tokens exactly (sampling: for the same seed); every
other call is Hugging Face's."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from llm_models import VOCAB, clone, prompts, tiny  # noqa: E402

import xlaunch.llm as llm  # noqa: E402
from xlaunch.llm.decoder import DecoderRuntime  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def model():
    return llm.optimize(clone(tiny("llama", seed=3)), dtype=torch.float32)


@pytest.fixture
def greedy_calls(monkeypatch):
    """The generate calls the runtime's loop ran."""
    calls = []
    original = DecoderRuntime.generate_tokens

    def counted(self, *args):
        calls.append(args)
        return original(self, *args)

    monkeypatch.setattr(DecoderRuntime, "generate_tokens", counted)
    return calls


def hugging_face(model, *args, **kwargs):
    """Hugging Face's own generate on the same optimized model (the class's method, not the instance's)."""
    return type(model).generate(model, *args, **kwargs)


class Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("batch,length", [(1, 1), (1, 20), (3, 20)])
def test_plain_greedy_calls_give_hugging_faces_tokens(model, greedy_calls, batch, length):
    ids, mask = prompts(batch, length, seed=batch + length)
    for kwargs in (dict(attention_mask=mask), dict(attention_mask=mask, eos_token_id=None)):
        got = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, **kwargs)
        assert torch.equal(got, hugging_face(model, ids, max_new_tokens=10, do_sample=False, pad_token_id=0, **kwargs))
    assert len(greedy_calls) == 2
    if batch == 1:    # no mask at all, the input given by keyword
        got = model.generate(input_ids=ids, max_new_tokens=5, pad_token_id=0)
        assert torch.equal(got, hugging_face(model, input_ids=ids, max_new_tokens=5, pad_token_id=0))
        assert len(greedy_calls) == 3


def test_end_of_sequence_padding_and_min_new_tokens_follow_hugging_face(model, greedy_calls):
    """A row that produces the end-of-sequence id is finished: pad from then on, and the call stops when every
    row is; min_new_tokens keeps that id out until then. The id is one the model really produces."""
    ids, mask = prompts(3, 12, seed=7)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 12 + 3])                       # row 0's fourth new token
    for extra in (dict(), dict(min_new_tokens=6), dict(eos_token_id=[eos, int(free[1, 12 + 5])])):
        kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos) | extra
        got = model.generate(ids, **kwargs)
        assert torch.equal(got, hugging_face(model, ids, **kwargs)), extra
    assert len(greedy_calls) == 4
    ended = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=12, eos_token_id=eos)   # no pad id
    assert ended.shape == (1, 12 + 4) and int(ended[0, -1]) == eos      # stopped at the end-of-sequence id
    assert torch.equal(ended, hugging_face(model, ids[:1], attention_mask=mask[:1], max_new_tokens=12, eos_token_id=eos))
    one = torch.cat([torch.zeros(1, 1, dtype=torch.long), ids[:1, 1:]], dim=1)   # holds id 0, no pad id, no mask
    assert torch.equal(model.generate(one, max_new_tokens=12, eos_token_id=eos),
                       hugging_face(model, one, max_new_tokens=12, eos_token_id=eos))
    assert len(greedy_calls) == 6


def test_a_given_generation_config_takes_its_unset_fields_from_the_models(model, greedy_calls):
    """As generate merges them: a config without an end-of-sequence id gets the model's (which here ends the
    reply early), and a call argument overrides both."""
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    free = model.generate(ids, max_new_tokens=8, pad_token_id=0, eos_token_id=None)
    own = model.generation_config
    saved = own.eos_token_id
    own.eos_token_id = int(free[0, 6 + 2])        # the model's own end-of-sequence id: the third new token
    try:
        config = type(own)(max_new_tokens=8, pad_token_id=0)
        got = model.generate(ids, generation_config=config)
        assert got.shape[1] <= 6 + 3 and int(got[0, -1]) == own.eos_token_id       # ended at the model's id
        assert torch.equal(got, hugging_face(model, ids, generation_config=config))
        got = model.generate(ids, generation_config=config, eos_token_id=None)
        assert got.shape == (1, 6 + 8) and torch.equal(got, hugging_face(model, ids, generation_config=config,
                                                                         eos_token_id=None))
    finally:
        own.eos_token_id = saved
    assert len(greedy_calls) == 3        # the first call included


def test_a_streamer_and_a_generation_config_are_honoured(model, greedy_calls):
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    ours, theirs = Recorder(), Recorder()
    config = type(model.generation_config)(max_new_tokens=7, do_sample=False, pad_token_id=0)
    got = model.generate(ids, generation_config=config, streamer=ours)
    assert torch.equal(got, hugging_face(model, ids, generation_config=config, streamer=theirs))
    assert ours.puts == theirs.puts and ours.ended == theirs.ended == 1 and len(ours.puts) == 8
    assert len(greedy_calls) == 1


@pytest.mark.parametrize("penalty", [1.3, 0.8])
@pytest.mark.parametrize("sample", [False, True])
def test_a_repetition_penalty_gives_hugging_faces_tokens(model, greedy_calls, penalty, sample):
    """Hugging Face's repetition penalty (Qwen2.5's instruct configs set 1.05) over prompt and reply, each row's
    left padding left out as generate leaves it out; greedy and sampled, padded batch and one row."""
    ids, mask = prompts(3, 10, seed=11)
    for rows in (3, 1):
        call = dict(attention_mask=mask[:rows], max_new_tokens=10, pad_token_id=0, repetition_penalty=penalty,
                    do_sample=sample)
        torch.manual_seed(5)
        got = model.generate(ids[:rows], **call)
        torch.manual_seed(5)
        assert torch.equal(got, hugging_face(model, ids[:rows], **call)), rows
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    if not sample:      # the penalty changes what a greedy reply is
        assert not torch.equal(plain, model.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0,
                                                     repetition_penalty=penalty))
    assert len(greedy_calls) == 3 + (0 if sample else 1)


@pytest.mark.parametrize("kwargs", [
    dict(num_beams=2), dict(return_dict_in_generate=True), dict(output_scores=True), dict(no_repeat_ngram_size=2),
    dict(max_length=12), dict(max_new_tokens=None), dict(use_cache=False), dict(logits_processor=None),
    dict(num_return_sequences=2, do_sample=True), dict(do_sample=True, typical_p=0.9), dict(temperature=0.7),
])
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")
def test_every_other_call_is_hugging_faces_own(model, greedy_calls, kwargs):
    ids, mask = prompts(2, 8, seed=4)
    call = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=0) | kwargs
    torch.manual_seed(0)
    got = model.generate(ids, **call)
    torch.manual_seed(0)
    expected = hugging_face(model, ids, **call)
    assert greedy_calls == []
    sequences = (lambda out: out if isinstance(out, torch.Tensor) else out.sequences)
    assert torch.equal(sequences(got), sequences(expected))


@pytest.mark.parametrize("sampling", [
    dict(), dict(temperature=0.7), dict(top_k=5), dict(top_k=0, top_p=0.8), dict(temperature=1.3, top_k=20, top_p=0.9),
    dict(min_p=0.05), dict(top_k=0, temperature=0.5, min_p=0.1), dict(top_k=None, top_p=0.9),
])
def test_sampling_gives_hugging_faces_tokens_for_the_same_seed(model, greedy_calls, sampling):
    """do_sample with temperature, top-k (generate's default 50 when unset; off when the call passes None: it was
    50), top-p and min-p: Hugging Face's own
    warpers in its order, then ``torch.multinomial``; a left-padded batch with an end-of-sequence id, and the
    config's own sampling fields (an instruct checkpoint's generation_config) as well as call arguments."""
    ids, mask = prompts(3, 10, seed=9)
    call = dict(attention_mask=mask, max_new_tokens=9, pad_token_id=0, eos_token_id=7, do_sample=True) | sampling
    outputs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        outputs.append(model.generate(ids, **call))
        torch.manual_seed(seed)
        assert torch.equal(outputs[-1], hugging_face(model, ids, **call)), (sampling, seed)
    assert not torch.equal(*outputs)        # the tokens really are drawn: another seed, other tokens
    config = type(model.generation_config)(do_sample=True, max_new_tokens=6, pad_token_id=0, **sampling)
    torch.manual_seed(2)
    got = model.generate(ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(2)
    assert torch.equal(got, hugging_face(model, ids, attention_mask=mask, generation_config=config))
    assert len(greedy_calls) == 3


def test_pads_without_a_mask_and_an_end_without_a_pad_id_go_to_hugging_face(model, greedy_calls):
    """generate infers a mask from pad ids in the input, and picks (and announces) a pad id for the finished
    rows of a batch with an end-of-sequence id and no pad id: both are Hugging Face's to do."""
    ids, mask = prompts(2, 8, seed=5)              # row 1 starts with pad id 0
    model.generate(ids, max_new_tokens=3, pad_token_id=0)
    model.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=5, pad_token_id=None)
    assert greedy_calls == []


def test_a_large_max_new_tokens_commits_only_the_slots_written(model):
    """generate sizes the KV cache to its maximum length (here 2^20 tokens: 1 GiB of buffers); the buffers are
    left uninitialized, so a reply that ends at its end-of-sequence id after a few tokens commits only the pages
    it wrote. The resident size is read on every step (a streamer), not after the cache is gone."""
    def resident_mib() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) // 1024

    ids = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))
    eos = int(model.generate(ids, max_new_tokens=3, pad_token_id=0)[0, -1])
    seen = []

    class Watch:
        def put(self, value) -> None:
            seen.append(resident_mib())

        def end(self) -> None:
            pass

    before = resident_mib()
    out = model.generate(ids, max_new_tokens=1 << 20, eos_token_id=eos, pad_token_id=0, streamer=Watch())
    assert out.shape[1] <= 4 + 3 and int(out[0, -1]) == eos
    assert max(seen) - before < 128, (before, seen)


def test_beam_search_under_a_large_max_new_tokens_copies_only_the_slots_written(model):
    """Beam search reorders the cache every step: it copied the whole capacity (generate's maximum length), so
    max_new_tokens=2^17 with 3 beams cost 400 MiB resident and most of a second a step where Hugging Face's cache
    costs what it holds. The resident size is read on every step (a stopping criterion), the tokens are generate's."""
    transformers = pytest.importorskip("transformers")

    def resident_mib() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) // 1024

    class Watch(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(resident_mib())
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 12, dtype=torch.bool)

    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    call = dict(num_beams=3, do_sample=False, pad_token_id=0, stopping_criteria=transformers.StoppingCriteriaList([Watch()]))
    seen: list[int] = []
    expected = tiny("llama", seed=3).generate(ids, max_new_tokens=6, **call)
    seen.clear()
    before = resident_mib()
    got = model.generate(ids, max_new_tokens=1 << 17, **call)
    assert torch.equal(got, expected)
    assert max(seen) - before < 64, (before, seen)


@pytest.mark.parametrize("how", ["assistant", "prompt_lookup"])
@pytest.mark.filterwarnings("ignore:Passing `generation_config` together")
def test_assisted_decoding_which_crops_the_cache_gives_the_greedy_tokens(model, how):
    """Assisted and prompt-lookup decoding verify several candidate tokens in one forward, then drop the rejected
    ones with ``cache.crop(-n)``: the tokens are greedy decoding's (crop(-n) kept n slots before: wrong tokens)."""
    ids = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 33, 5, 9]])    # repeats: prompt lookup has candidates
    expected = model.generate(ids, max_new_tokens=12)
    extra = dict(assistant_model=tiny("llama", seed=9)) if how == "assistant" else dict(prompt_lookup_num_tokens=3)
    cropped = []
    original = llm.cache.hf_cache_class().crop

    def counted(self, tokens_to_remove):
        cropped.append(tokens_to_remove)
        return original(self, tokens_to_remove)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm.cache.hf_cache_class(), "crop", counted)
        got = model.generate(ids, max_new_tokens=12, **extra)
    assert any(count < 0 for count in cropped), cropped        # candidates were rejected and cropped away
    assert torch.equal(got, expected)


def test_a_kv_cache_crops_as_hugging_faces_caches_do(model):
    _, cache = model(torch.tensor([[1, 2, 3, 4, 5]]), return_dict=False)
    cache.crop(0)
    assert cache.get_seq_length() == 5
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(2)


def test_end_ids_outside_the_vocabulary_or_in_a_tensor_follow_hugging_face(model, greedy_calls):
    """min_new_tokens bans only the end ids that are tokens, as generate's processor does (an id past the vocabulary
    was an IndexError, a negative one banned a token counted from the end); a tensor of end ids is taken as generate
    takes it (it was "Boolean value of Tensor ... is ambiguous")."""
    ids, mask = prompts(3, 10, seed=6)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=1)[:, -1]
    for eos in ([VOCAB + 88, 7], [int(first[0]) - VOCAB], torch.tensor([7, VOCAB + 88]), torch.tensor(7)):
        call = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=2, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(model.generate(ids, **call), hugging_face(model, ids, **call)), eos
    assert len(greedy_calls) == 4          # the four calls with a pad id (the first has none: generate's)


@pytest.mark.parametrize("cache_class", ["StaticCache", "DynamicCache"])
def test_an_empty_cache_of_another_type_gives_the_reference_tokens_with_left_padding(model, cache_class):
    """An empty cache the call passes is replaced by the model's KVCache: a StaticCache made generate build 4-D
    masks for the prompt, which the runtime did not read, so padded rows attended to their padding (wrong tokens)."""
    cache_type = getattr(pytest.importorskip("transformers"), cache_class)
    reference = tiny("llama", seed=3)
    ids, mask = prompts(3, 16, seed=4)
    call = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    made = dict(max_cache_len=32) if cache_class == "StaticCache" else {}
    expected = reference.generate(ids, **call)
    assert torch.equal(model.generate(ids, past_key_values=cache_type(config=model.config, **made), **call), expected)


def test_a_mask_that_is_not_2d_is_refused_in_one_line(model):
    """The runtime reads a mask as padding slots: a 4-D mask (packed documents) was ignored, giving causal logits."""
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    four_d = torch.zeros(1, 1, 6, 6)
    with pytest.raises(ValueError, match=r"^xlaunch.llm: attention_mask must be 2-D \[batch, length\].*\(1, 1, 6, 6\)"):
        model(ids, attention_mask=four_d)


def test_a_cache_given_with_use_cache_false_is_continued_as_hugging_faces_forward_continues_it(model):
    """use_cache=False dropped a given past_key_values: the new tokens were computed as a fresh prompt (logits 0.9
    off Hugging Face's, which attends to the cache, advances it and returns it)."""
    reference = tiny("llama", seed=3)
    ids, mask = prompts(2, 10, seed=7)
    with torch.no_grad():
        first, mine = reference(ids[:, :6], attention_mask=mask[:, :6]), model(ids[:, :6], attention_mask=mask[:, :6])
        expected = reference(ids[:, 6:], attention_mask=mask, past_key_values=first.past_key_values, use_cache=False)
    got = model(ids[:, 6:], attention_mask=mask, past_key_values=mine.past_key_values, use_cache=False)
    assert torch.allclose(got.logits, expected.logits, rtol=0, atol=1e-4)
    assert got.past_key_values is mine.past_key_values and got.past_key_values.get_seq_length() == 10
    assert model(ids, attention_mask=mask, use_cache=False).past_key_values is None


@pytest.mark.parametrize("other", [dict(num_hidden_layers=1), dict(num_hidden_layers=3), dict(num_key_value_heads=4)])
def test_another_models_cache_is_one_value_error(model, other):
    """A draft model's cache passed to the main model: fewer layers was an IndexError, more ran silently on the first
    layers' slots, other KV heads failed inside the kernel."""
    ids, _ = prompts(1, 6, seed=2)
    cache = llm.optimize(tiny("llama", seed=3, **other), dtype=torch.float32)(ids).past_key_values
    with pytest.raises(ValueError, match=r"^xlaunch.llm: past_key_values is another model's KV cache \("):
        model(ids[:, :2], past_key_values=cache)


@pytest.mark.parametrize("case", ["right padding", "end id below 0", "min_new_tokens past the maximum", "plain"])
def test_the_runtimes_loop_says_what_generate_says(model, greedy_calls, case):
    """generate warns of a batch padded on the right (a tokenizer left at padding_side='right'), an end id below 0
    and min_new_tokens past the maximum length; the runtime's loop gave the same tokens without a word."""
    import logging

    ids, mask = prompts(3, 10, seed=6)
    call = dict(attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    if case == "right padding":
        ids, call["attention_mask"] = ids.flip(1), mask.flip(1)
    elif case == "end id below 0":
        call["eos_token_id"] = -1
    elif case == "min_new_tokens past the maximum":
        call["min_new_tokens"] = 5
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    said = []
    try:
        for generate in (model.generate, lambda *a, **k: hugging_face(model, *a, **k)):
            records.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                generate(ids, **call)
            said.append(records + [str(w.message) for w in caught])
    finally:
        logger.removeHandler(handler)
    assert len(greedy_calls) == 1
    assert said[0] == said[1] and bool(said[0]) == (case != "plain"), said


@pytest.mark.parametrize("call,option", [
    (dict(input_ids=torch.ones(2, 6)), "input_ids"), (dict(input_ids=torch.ones(6, dtype=torch.long)), "input_ids"),
    (dict(input_ids=torch.ones(2, 0, dtype=torch.long)), "input_ids"), (dict(inputs_embeds=torch.ones(2, 6, 64)), "inputs_embeds"),
    (dict(attention_mask=torch.ones(1, 6)), "attention_mask"), (dict(attention_mask=torch.ones(2, 3)), "attention_mask"),
    (dict(position_ids=torch.arange(3)[None]), "position_ids"), (dict(position_ids=torch.ones(2, 6)), "position_ids"),
])
def test_inputs_the_forward_cannot_take_are_one_line_naming_them(model, call, option):
    """They failed inside a reshape, torch's embedding or the attention kernel ('key_padding must be [B, start + S]';
    a mask of one row without zeros was taken for every row)."""
    call = dict(input_ids=torch.ones(2, 6, dtype=torch.long)) | call
    if "inputs_embeds" in call:
        call.pop("input_ids")
    with pytest.raises(ValueError, match=f"^xlaunch.llm: {option} ") as info:
        model(**call)
    assert "\n" not in str(info.value)


def test_a_mask_longer_than_the_input_is_read_from_its_first_column_as_transformers_reads_it():
    """Slot j is column j: a mask kept at a fixed length, ones then zeros for the positions to come, was read from its
    end (its zeros taken for the prompt's padding: other logits than Hugging Face's)."""
    reference = tiny("llama", seed=3)
    model = llm.optimize(clone(reference), dtype=torch.float32)
    ids, mask = prompts(2, 8, seed=5)
    longer = torch.cat([mask, torch.zeros(2, 5, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        expected = reference(ids, attention_mask=longer).logits
    got = model(ids, attention_mask=longer).logits
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("bad", [dict(do_sample=True, temperature=0.0), dict(do_sample=True, temperature=-1.0),
                                 dict(do_sample=True, top_k=-1), dict(do_sample=True, min_p=2.0),
                                 dict(repetition_penalty=0.0), dict(do_sample=True, repetition_penalty=-1.0)])
def test_values_generate_refuses_are_its_own_error(model, greedy_calls, bad):
    """The runtime's loop took them: a negative temperature, min_p 2 and a penalty of 0 or -1 gave tokens, a zero
    temperature and top_k -1 failed inside torch; generate's processors refuse each in one ValueError."""
    ids, mask = prompts(2, 6, seed=3)
    call = dict(attention_mask=mask, max_new_tokens=3, pad_token_id=0) | bad
    with pytest.raises(ValueError) as expected:
        hugging_face(model, ids, **call)
    with pytest.raises(ValueError) as got:
        model.generate(ids, **call)
    assert str(got.value) == str(expected.value)
    assert greedy_calls == []


def test_a_max_new_tokens_past_the_address_space_decodes_to_its_end_id(model, greedy_calls):
    """"Until the end id": max_new_tokens=10**13 sized the KV cache to 2.5 PB ("can't allocate memory"); plain Hugging
    Face's cache grows as it goes. The cache starts small and grows when its maximum cannot be had."""
    ids = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))
    expected = model.generate(ids, max_new_tokens=5, pad_token_id=0)
    eos = int(expected[0, -1])
    call = dict(max_new_tokens=10 ** 13, eos_token_id=eos, pad_token_id=0)
    got = model.generate(ids, **call)
    assert torch.equal(got, expected[:, :got.shape[1]]) and int(got[0, -1]) == eos
    assert torch.equal(hugging_face(model, ids, **call), got)          # generate's own loop, its cache sized alike
    assert len(greedy_calls) == 2
