"""``xlaunch.llm.optimize``: pack a Hugging Face decoder's weights and give it the fused forward.

The model object itself is changed and returned, so ``model.generate(...)`` and ``model(...)``
keep working: its q/k/v and gate/up linears become one :class:`~xlaunch.llm.linear.PackedLinear`
each, o/down/lm_head are packed alone, norms take the dtype, the embedding too (or stays 16-bit under fp32
activations where its values are 16-bit: :func:`~xlaunch.llm.decoder.embedding_table`; a tied one reads
the packed lm_head's rows: one copy), and ``model.forward``
runs :class:`~xlaunch.llm.decoder.DecoderRuntime` over a preallocated
:class:`~xlaunch.llm.cache.KVCache` that ``generate`` sizes to its maximum length.
"""
from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Optional

from xlaunch._errors import as_index
from xlaunch._torch import import_quietly, needs_torch

with needs_torch(__name__):
    import torch

# transformers' torchao quantizer imports torchao, whose import logs CUDA-only misses: import it quietly first
import_quietly("transformers.quantizers.auto", "torchao.quantization", chain=True)   # no transformers: no torchao

from xlaunch.llm import footprint, native  # noqa: E402
from xlaunch.llm.shapes import SUPPORTED_ARCHITECTURES, DecoderSpec, describe  # noqa: E402
from xlaunch.llm.cache import KVBuffers, hf_cache_class, needs_transformers  # noqa: E402
from xlaunch.llm.decoder import (DTYPES, DecoderRuntime, LayerWeights, RopeTable, TokenEmbedding,  # noqa: E402
                                 embedding_table, repetition_penalty, warpers)
from xlaunch.llm.linear import GROUP_SIZES, PackedLinear  # noqa: E402

with needs_transformers("xlaunch.llm"):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import logging as hf_logging

__all__ = ["optimize", "SUPPORTED_ARCHITECTURES", "is_optimized"]

UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")
WEIGHTS = (None, "int8", "int4")
MARK = "_xlaunch_llm"
BF16_FLAGS = footprint.BF16_FLAGS


def native_bf16() -> bool:
    """Whether this CPU has native bf16 dot products (AVX512_BF16 or AMX_BF16), from the machine model.

    Without them bf16 activations are the slowest route (every product widened to fp32 first), so
    :func:`optimize` defaults to fp32 activations there and warns when bf16 is asked for.
    """
    return footprint.native_bf16()


def default_dtype() -> Any:
    """The activations' dtype :func:`optimize` takes when none is given: bf16 where it is native, else fp32."""
    return torch.bfloat16 if native_bf16() else torch.float32


class _Retired(torch.nn.Module):
    """Stands where a linear was packed into a fused one; calling it says so."""

    def __init__(self, into: str) -> None:
        super().__init__()
        self.into = into

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"xlaunch.llm.optimize packed this linear into {self.into}; call the model itself")

    def extra_repr(self) -> str:
        return f"packed into {self.into}"


def is_optimized(model: Any) -> bool:
    """Whether :func:`optimize` has already been applied to ``model``."""
    return getattr(model, MARK, None) is not None


def _check(dtype: Any, weights: Optional[str], group_size: int, caller: str = "xlaunch.llm.optimize") -> str:
    if dtype not in DTYPES:
        raise ValueError(f"{caller}: dtype must be torch.bfloat16 or torch.float32, not {dtype!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"{caller}: weights must be None, 'int8' or 'int4', not {weights!r}")
    if weights == "int4" and as_index(group_size) not in GROUP_SIZES:      # 64.0 passed 'in' and failed in a reshape
        raise ValueError(f"{caller}: group_size must be one of {GROUP_SIZES}, not {group_size!r}")
    return weights or DTYPES[dtype]


def _check_groups(model: Any, group_size: int) -> None:
    """INT4 packs each decoder linear per group of ``group_size`` inputs: one ValueError naming the first linear whose
    inputs it does not divide (and the group sizes that would do), before any layer is packed (the packing failed
    halfway, the layers before it already packed)."""
    named = [(f"model.layers.{index}.{part}.{name}", getattr(getattr(layer, part), name))
             for index, layer in enumerate(model.model.layers)
             for part, names in (("self_attn", ("q_proj", "o_proj")), ("mlp", ("gate_proj", "down_proj")))
             for name in names]
    sizes = {linear.in_features for _, linear in named}
    for name, linear in named:
        if linear.in_features % group_size:
            fits = [size for size in GROUP_SIZES if all(k % size == 0 for k in sizes)]
            hint = f"group_size={' or '.join(map(str, fits))} fits every layer" if fits else "use weights='int8'"
            raise ValueError(f"xlaunch.llm.optimize: group_size {group_size} does not divide the {linear.in_features} "
                             f"inputs of {name}; {hint}")


def _pack_layer(layer: Any, kind: str, dtype: Any, group_size: int, window: Optional[int]) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    pack = dict(kind=kind, dtype=dtype, group_size=group_size)
    attention.qkv_proj = PackedLinear.from_linears([attention.q_proj, attention.k_proj, attention.v_proj], **pack)
    attention.o_proj = PackedLinear.from_linears([attention.o_proj], **pack)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, _Retired("self_attn.qkv_proj"))
    mlp.gate_up_proj = PackedLinear.from_linears([mlp.gate_proj, mlp.up_proj], **pack)
    mlp.down_proj = PackedLinear.from_linears([mlp.down_proj], **pack)
    for name in ("gate_proj", "up_proj"):
        setattr(mlp, name, _Retired("mlp.gate_up_proj"))
    layer.input_layernorm.to(dtype)
    layer.post_attention_layernorm.to(dtype)
    return LayerWeights(input_norm=layer.input_layernorm.weight.detach(),
                        post_attention_norm=layer.post_attention_layernorm.weight.detach(),
                        qkv=attention.qkv_proj, out=attention.o_proj, gate_up=mlp.gate_up_proj, down=mlp.down_proj,
                        window=window)


def _runtime(model: Any) -> DecoderRuntime:
    return getattr(model, MARK)


def _forward(self: Any, input_ids: Optional["torch.Tensor"] = None, attention_mask: Optional["torch.Tensor"] = None,
             position_ids: Optional["torch.Tensor"] = None, past_key_values: Any = None,
             inputs_embeds: Optional["torch.Tensor"] = None, labels: Optional["torch.Tensor"] = None,
             use_cache: Optional[bool] = None, logits_to_keep: Any = 0, **kwargs: Any) -> Any:
    """Hugging Face's causal-LM forward, run by xlaunch.llm's optimized decoder."""
    for name in UNSUPPORTED_OUTPUTS:
        if kwargs.get(name):
            raise ValueError(f"xlaunch.llm: {name}=True is not supported by the optimized model")
    return_dict = kwargs.get("return_dict")
    if use_cache is None:
        use_cache = bool(getattr(self.config, "use_cache", True))
    runtime = _runtime(self)
    logits, cache = runtime.forward(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds,
                                    use_cache, logits_to_keep)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=runtime.spec.vocab_size)
    if return_dict is False:
        return tuple(item for item in (loss, logits, cache) if item is not None)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)


def _prepare_cache(self: Any, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
    """``generate``'s cache preparation, then its cache replaced by a KVCache sized to its maximum length: the cache
    generate made, or an empty one of another type the call passed (a StaticCache made generate build 4-D masks,
    which would hide the prompt's left padding; the runtime fills only its own KVCache)."""
    result = type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)
    cache = model_kwargs.get("past_key_values")
    maximum = kwargs.get("max_cache_length", args[-1] if args else None)
    foreign_empty = not isinstance(cache, KVBuffers) and callable(getattr(cache, "get_seq_length", None)) \
        and cache.get_seq_length() == 0
    if cache is not None and (foreign_empty or not getattr(cache, "_is_user_defined", False)) \
            and isinstance(maximum, int):
        model_kwargs["past_key_values"] = _runtime(self).new_cache(capacity=maximum)
    return result


# GenerationConfig fields the runtime's loop honours (DecoderRuntime.generate_tokens); any other one set sends a
# call to Hugging Face's own generate, as do beams, logits processors, stopping criteria and returned dicts.
# SAMPLING_FIELDS only with do_sample (greedy with them set is generate's, which warns that they are unused).
LOOP_FIELDS = {"max_new_tokens", "min_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id", "do_sample",
               "num_beams", "num_return_sequences", "use_cache", "repetition_penalty", "transformers_version",
               "_from_model_config"}
SAMPLING_FIELDS = {"temperature", "top_k", "top_p", "min_p"}
RIGHT_PADDING = ("A decoder-only architecture is being used, but right-padding was detected! For correct generation "
                 "results, please set `padding_side='left'` when initializing the tokenizer.")     # generate's warning
OFF_FIELDS = {"output_attentions", "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate"}


def _warpers(config: Any, kwargs: dict) -> list:
    """The logits warpers of a sampling ``config`` (temperature, top-k, top-p, min-p), as ``generate`` builds them
    for one beam: the same conditions, order and values (:func:`xlaunch.llm.decoder.warpers`). generate fills
    its defaults before the call's arguments, so ``top_k=None`` in the call turns top-k off (not 50)."""
    top_k = 0 if "top_k" in kwargs and kwargs["top_k"] is None else config.top_k
    return warpers(config.temperature, top_k, config.top_p, config.min_p)


def _loop_plan(model: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
    """(ids, mask, new, min_new, eos, pad, streamer, warpers, penalties) when a ``generate`` call is one-beam
    greedy or sampling (temperature, top-k, top-p, min-p), with or without a repetition penalty, that
    :meth:`DecoderRuntime.generate_tokens` reproduces token for token (sampling: for the same seed); None sends
    it to Hugging Face's generate."""
    kwargs = dict(kwargs)
    ids = args[0] if args else kwargs.pop("inputs", None)
    ids = kwargs.pop("input_ids", None) if ids is None else ids
    streamer, mask = kwargs.pop("streamer", None), kwargs.pop("attention_mask", None)
    given, own = kwargs.pop("generation_config", None), getattr(model, "generation_config", None)
    if len(args) > 1 or own is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] == 0 \
            or ids.dtype not in (torch.long, torch.int32) or not isinstance(mask, (torch.Tensor, type(None))) \
            or getattr(model.config, "_get_generation_parameters", dict)():   # generate refuses the legacy way
        return None
    # generate's merge: the given config (or a blank one), its unset fields from the model's, then the call's
    config = copy.deepcopy(given) if given is not None else type(own)()
    config.update(**own.to_dict(), defaults_only=True, allow_custom_entries=True)
    if config.update(**kwargs):      # model kwargs left (past_key_values, logits_processor...)
        return None
    allowed = LOOP_FIELDS | (SAMPLING_FIELDS if config.do_sample else set())
    if not {name for name, value in config.to_diff_dict().items() if name not in OFF_FIELDS or value} <= allowed:
        return None
    if (config.num_beams or 1) != 1 or (config.num_return_sequences or 1) != 1 \
            or config.use_cache is False or not isinstance(config.max_new_tokens, int) or config.max_new_tokens < 1:
        return None
    eos = config.eos_token_id
    eos = None if eos is None else torch.as_tensor(eos).long().reshape(-1)     # an id, a list or a tensor of them
    pad = config.pad_token_id
    pad = int(pad) if isinstance(pad, torch.Tensor) and pad.numel() == 1 else pad
    if eos is not None and pad is None and ids.shape[0] > 1:
        return None               # generate picks a pad id for finished rows and says so: let it
    if mask is None and pad is not None and bool((ids == pad).any()):
        return None               # generate infers a mask from the pad ids
    if mask is not None and (mask.shape != ids.shape or not bool((mask == 1).logical_or(mask == 0).all())):
        return None
    try:
        warpers, penalties = _warpers(config, kwargs) if config.do_sample else None, _penalties(config, mask)
    except ValueError:
        return None               # a value generate's processors refuse: its own error
    _say_what_generate_says(model, config, ids, mask)
    pad = 0 if pad is None else pad     # one row without a pad id: never padded (its end-of-sequence id ends it)
    return ids, mask, config.max_new_tokens, config.min_new_tokens or 0, eos, pad, streamer, warpers, penalties


def _say_what_generate_says(model: Any, config: Any, ids: "torch.Tensor", mask: Optional["torch.Tensor"]) -> None:
    """The warnings ``generate`` gives for a call the runtime's loop runs (an end id below 0, min_new_tokens past the
    maximum length, a batch padded on the right, no mask with a batch...), by its own checks in its order, on the
    loop's copy of the config: the loop skips generate's body, and with it what generate would have said."""
    batch, length = ids.shape
    prepare, lengths, validate = (getattr(model, name, None) for name in (
        "_prepare_special_tokens", "_prepare_generated_length", "_validate_generated_length"))
    if callable(prepare):
        prepare(config, mask is not None, device=ids.device, batch_size=batch)
    if getattr(config, "_pad_token_tensor", config.pad_token_id) is not None and mask is not None and batch > 1 \
            and bool((mask[:, -1] == 0).any()):
        hf_logging.get_logger("transformers.generation.utils").warning(RIGHT_PADDING)
    if callable(lengths):          # max_length from max_new_tokens, min_length from min_new_tokens, as generate sets them
        config = lengths(generation_config=config, has_default_max_length=True, has_default_min_length=True,
                         model_input_name="input_ids", inputs_tensor=ids, input_ids_length=length)
    if callable(validate):
        validate(config, length, True)


def _penalties(config: Any, mask: Optional["torch.Tensor"]) -> list:
    """The repetition penalty as ``generate`` applies it: each row's left padding left out of it (the mask's
    leading zeros; generate has dropped a mask of ones by then, so none)."""
    return repetition_penalty(config.repetition_penalty, mask)


def _generate(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Hugging Face's generate; one-beam greedy and plain sampling calls (:func:`_loop_plan`) run
    :meth:`DecoderRuntime.generate_tokens`, the same tokens without Hugging Face's per-step Python (a 168M INT4
    model at 2 threads, Zen 5 VM: 3.16 -> 2.42 ms a token)."""
    plan = _loop_plan(self, args, kwargs)
    return type(self).generate(self, *args, **kwargs) if plan is None else _runtime(self).generate_tokens(*plan)


def warn_if_bf16_is_slow(dtype: Any, caller: str, stacklevel: int = 2) -> None:
    """One warning when bf16 activations are asked for on a CPU without native bf16 dot products."""
    if dtype == torch.bfloat16 and not native_bf16():
        warnings.warn(f"{caller}: neither AVX512_BF16 nor AMX_BF16 at this CPU's kernel level, so bf16 activations "
                      "are widened to fp32 for every product and each layer's output is rounded to bf16; "
                      "dtype=torch.float32 is the default here", UserWarning, stacklevel=stacklevel + 1)


def lm_head_packing(kind: str, in_features: int, group_size: int) -> tuple[str, int]:
    """(kind, group size) of lm_head under the layers' ``kind`` (:func:`xlaunch.llm.footprint.lm_head_kind`)."""
    return footprint.lm_head_packing(kind, in_features, group_size, kernels=native.ops() is not None)


def optimize(model: Any, dtype: Any = None, weights: Optional[str] = None, group_size: int = 128) -> Any:
    """Optimize a Hugging Face Llama, Mistral or Qwen2 causal LM for CPU decoding, in place; returns it.

    ``dtype``: the activations' and unquantized weights' dtype, ``torch.bfloat16`` or
    ``torch.float32``; by default bf16 where the CPU has native bf16 (AVX512_BF16 or AMX), else fp32
    (a bf16 request there gets one warning). ``weights``: ``None`` keeps weights in ``dtype``; ``"int8"`` quantizes every
    linear (lm_head included) per output channel; ``"int4"`` quantizes the decoder layers' linears
    per group of ``group_size`` inputs (32, 64 or 128) and lm_head to 6 bits in groups of 64 (INT8 without the
    compiled kernels, or when its inputs are no multiple of 64: ``footprint.lm_head_kind``). Inference only.
    An architecture it does not know gets one warning and comes back unchanged.
    """
    dtype = default_dtype() if dtype is None else dtype
    kind = _check(dtype, weights, group_size)
    spec = describe(model)
    if not isinstance(spec, DecoderSpec):
        if is_optimized(model):
            _warn_if_packed_otherwise(model, dtype, kind, group_size)
            return model
        warnings.warn(f"xlaunch.llm.optimize: {spec}; the model is returned unchanged", UserWarning, stacklevel=2)
        return model
    if kind == "int4":
        _check_groups(model, group_size)
    warn_if_bf16_is_slow(dtype, "xlaunch.llm.optimize")     # at the line that called optimize
    model.eval()
    inner = model.model
    with torch.no_grad():
        layers = [_pack_layer(layer, kind, dtype, group_size, window)
                  for layer, window in zip(inner.layers, spec.windows)]
        head_kind, head_group = lm_head_packing(kind, model.lm_head.in_features, group_size)
        tied = spec.tied_embeddings and model.lm_head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
        model.lm_head = PackedLinear.from_linears([model.lm_head], kind=head_kind, dtype=dtype, group_size=head_group)
        table = None if tied else embedding_table(inner.embed_tokens.weight, dtype)
        inner.embed_tokens = TokenEmbedding(table, dtype, model.lm_head)
        inner.norm.to(dtype)
    runtime = DecoderRuntime(spec, dtype, table, layers, inner.norm.weight.detach(),
                             model.lm_head, RopeTable.of(inner.rotary_emb, spec.head_dim, dtype))
    attach(model, runtime)
    return model


def _warn_if_packed_otherwise(model: Any, dtype: Any, kind: str, group_size: int) -> None:
    """An optimized model is returned as it is; asked for another precision than it holds, one warning says so (it
    came back in its first precision without a word, the caller believing it had the second)."""
    runtime = _runtime(model)
    layer = runtime.layers[0].qkv
    held = (runtime.dtype, layer.kind, layer.group_size if layer.kind == "int4" else None)
    if held != (dtype, kind, group_size if kind == "int4" else None):
        def name(dtype: Any, kind: str, group: Optional[int]) -> str:
            weights = kind if kind in WEIGHTS else "none"
            return f"{str(dtype).replace('torch.', '')}, weights {weights}{f', group_size {group}' if group else ''}"
        warnings.warn(f"xlaunch.llm.optimize: the model is already optimized ({name(*held)}) and is returned as it is, "
                      f"not as {name(dtype, kind, group_size if kind == 'int4' else None)}; optimize the original model "
                      "for that", UserWarning, stacklevel=3)


def _apply(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``Module._apply`` of an optimized model, behind ``.to(dtype or device)``, ``.float()``, ``.half()``...

    The packed weights are in the layout and precision :func:`optimize` chose and the runtime holds them: a
    conversion to the activations' dtype on the CPU leaves the model as it is (it computes in that dtype already;
    one that changes no tensor, ``.cpu()`` or ``.share_memory()``, is applied), any other is one ValueError before
    anything changes (it cast the packed weights under the runtime: a failure inside a kernel, or a
    ``model.dtype`` that was not what ran)."""
    dtype = _runtime(self).dtype
    changed = {}
    for kind in {t.dtype for t in (*self.parameters(), *self.buffers())} | {dtype}:
        probe = torch.empty(0, dtype=kind)
        moved = fn(probe)
        if not isinstance(moved, torch.Tensor) or moved.dtype != kind or moved.device != probe.device:
            changed[kind] = moved
    if not changed:
        return type(self)._apply(self, fn, *args, **kwargs)
    if dtype not in changed:
        return self             # already computing in that dtype on the CPU; the packed storage stays
    moved = changed[dtype]
    target = f"{moved.dtype} on {moved.device}" if isinstance(moved, torch.Tensor) else type(moved).__name__
    raise ValueError(f"xlaunch.llm: this optimized model computes in {str(dtype).replace('torch.', '')} on the CPU "
                     f"with packed weights and cannot be converted to {target}; optimize the original model with the "
                     "dtype you want (xlaunch.llm.optimize(model, dtype=...))")


def _save_pretrained(self: Any, *args: Any, **kwargs: Any) -> None:
    """Refused: it would write packed tensors under names transformers does not load (the reloaded model's q/k/v
    and gate/up newly initialized)."""
    raise ValueError("xlaunch.llm: save_pretrained of an optimized model would write packed weights that "
                     "transformers does not load; save the model before xlaunch.llm.optimize, or its packed "
                     "form with xlaunch.llm.save_packed(model, path)")


def attach(model: Any, runtime: DecoderRuntime) -> None:
    """Make ``runtime`` the Hugging Face ``model``'s forward, its caches ``KVCache``, and its ``generate`` the
    runtime's loop where that gives generate's tokens; dtype conversions and save_pretrained are guarded. Each is
    a module function given the model (a partial: ``inspect.signature`` sees the method's), which finds the runtime
    on it: a ``copy.deepcopy`` or a pickled copy (``torch.save``/``torch.load``) of the model runs its own."""
    runtime.cache_type = hf_cache_class()
    object.__setattr__(model, MARK, runtime)      # plain attribute: not a submodule, not in the state dict
    methods = dict(forward=_forward, generate=_generate, _apply=_apply, save_pretrained=_save_pretrained)
    if getattr(model, "_prepare_cache_for_generation", None) is not None:
        methods["_prepare_cache_for_generation"] = _prepare_cache
    for name, method in methods.items():
        setattr(model, name, functools.partial(method, model))
    if hasattr(model.config, "dtype"):
        model.config.dtype = runtime.dtype
