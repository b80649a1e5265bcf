"""Decode from a packed file without transformers: :func:`load_decoder` and :class:`Decoder`.

A process that serves a packed file (say one of ``xlaunch --ninstances N``'s instances) needs the
mapped weights, the runtime and a decoding loop, not Hugging Face's model classes. Importing
transformers' modeling and generation modules costs each process about 135 MiB of private memory
(torch._dynamo through the generation utilities, torchao through the quantizers when it is
installed) before any weight: as much as one more instance's KV cache at long context. Here only
torch and xlaunch.llm's kernels are imported; the decoder's shape, RoPE frequencies and generation
defaults come from the file's manifest.

``Decoder.generate`` takes the arguments of Hugging Face's one-beam ``generate`` that the runtime's
loop honours, merged as ``generate`` merges them over the checkpoint's generation config, and gives
the same tokens as ``xlaunch.llm.from_pretrained(path).generate`` (sampling: for the same seed), with
the same logits processing (:func:`xlaunch.llm.decoder.warpers`).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from xlaunch._torch import needs_torch
from xlaunch.node_copies import placed

with needs_torch(__name__):
    import torch

from xlaunch.llm.cache import KVBuffers  # noqa: E402
from xlaunch.llm.decoder import DTYPES, DecoderRuntime  # noqa: E402
from xlaunch.llm.files import user_path  # noqa: E402
from xlaunch.llm.linear import GROUP_SIZES  # noqa: E402
from xlaunch.llm.decoder import repetition_penalty as penalty_processors, warpers as sampling_warpers  # noqa: E402
from xlaunch.llm.packed_file import PackedFileError, load_runtime  # noqa: E402

# generate's own defaults, for what neither the call nor the checkpoint's generation config sets
GENERATION_DEFAULTS = dict(max_length=None, max_new_tokens=None, min_length=0, min_new_tokens=0, do_sample=False,
                           temperature=1.0, top_k=50, top_p=1.0, min_p=None, repetition_penalty=1.0,
                           eos_token_id=None, pad_token_id=None)
DEFAULT_NEW_TOKENS = 20          # generate's, when no length is set anywhere (up to the model's positions)
# generation-config fields that change generate's tokens and that this loop does not apply, with their neutral values
NOT_APPLIED = dict(num_beams=(None, 1), num_beam_groups=(None, 1), penalty_alpha=(None, 0), typical_p=(None, 1.0),
                   epsilon_cutoff=(None, 0.0), eta_cutoff=(None, 0.0), no_repeat_ngram_size=(None, 0),
                   encoder_repetition_penalty=(None, 1.0), bad_words_ids=(None,), suppress_tokens=(None,),
                   begin_suppress_tokens=(None,), forced_bos_token_id=(None,), forced_eos_token_id=(None,),
                   sequence_bias=(None,), guidance_scale=(None, 1.0), top_h=(None,), renormalize_logits=(None, False),
                   exponential_decay_length_penalty=(None,), watermarking_config=(None,))


def _number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low < value if low_open else low <= value) \
            or value > high:
        bound = f"{'>' if low_open else '>='} {low}" + ("" if high == float("inf") else f" and <= {high}")
        raise ValueError(f"xlaunch.llm.Decoder.generate: {name} must be a number {bound}, not {value!r}")
    return float(value)


def _ids(name: str, value: Any) -> Optional["torch.Tensor"]:
    if value is None:
        return None
    listed = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if not listed or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in listed):
        raise ValueError(f"xlaunch.llm.Decoder.generate: {name} must be a token id or a list of them, not {value!r}")
    return torch.tensor(listed, dtype=torch.long)


class Decoder:
    """A packed file's decoder: ``decoder(ids)`` gives logits, ``decoder.generate(ids, ...)`` tokens.

    ``spec`` (:class:`~xlaunch.llm.shapes.DecoderSpec`), ``dtype`` (activations), ``weights`` (the packed
    precision: bf16, fp32, int8 or int4), ``config`` and ``generation_config`` (the checkpoint's, as dicts)
    describe it; ``runtime`` is the :class:`~xlaunch.llm.decoder.DecoderRuntime` it runs.
    """

    def __init__(self, runtime: DecoderRuntime, manifest: dict, path: Path) -> None:
        self.runtime, self.path = runtime, path
        self.mapped = path            # the file mapped: ``path``, or its node's copy
        self.spec, self.dtype = runtime.spec, runtime.dtype
        self.weights = manifest.get("weights")
        for key in ("config", "generation_config"):
            if not isinstance(manifest.get(key) or {}, dict):
                raise PackedFileError(f"xlaunch.llm: {path}: the manifest's {key} is malformed")
        self.config = dict(manifest.get("config") or {})
        self.generation_config = dict(manifest.get("generation_config") or {})
        self.not_applied = sorted(name for name, neutral in NOT_APPLIED.items()
                                  if self.generation_config.get(name) not in neutral)
        if self.not_applied:
            warnings.warn(f"xlaunch.llm.load_decoder: {path}'s generation config sets "
                          f"{', '.join(f'{n}={self.generation_config[n]!r}' for n in self.not_applied)}, which "
                          "Decoder.generate does not apply (one beam; temperature, top-k, top-p, min-p and the "
                          "repetition penalty); xlaunch.llm.from_pretrained(path).generate does", UserWarning,
                          stacklevel=3)

    def __repr__(self) -> str:
        spec = self.spec
        return (f"Decoder({self.path.name}: {spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
                f"vocabulary {spec.vocab_size}, weights {self.weights}, activations {str(self.dtype)[6:]})")

    def new_cache(self, capacity: int = 0) -> KVBuffers:
        """An empty KV cache (``capacity`` slots allocated on first use; more double it)."""
        return self.runtime.new_cache(capacity)

    def __call__(self, input_ids: "torch.Tensor", cache: Optional[KVBuffers] = None,
                 attention_mask: Optional["torch.Tensor"] = None, position_ids: Optional["torch.Tensor"] = None,
                 logits_to_keep: int = 0) -> tuple["torch.Tensor", KVBuffers]:
        """(logits [B, S or logits_to_keep, vocab], the cache advanced by ``input_ids`` [B, S]); a new cache
        when ``cache`` is None. ``attention_mask`` covers the cache and the input (0: left padding)."""
        logits, advanced = self.runtime.forward(input_ids, attention_mask, position_ids, cache, None, True, logits_to_keep)
        return logits, advanced

    def _setting(self, name: str, given: Any) -> Any:
        if given is not None:
            return given
        recorded = self.generation_config.get(name)
        return GENERATION_DEFAULTS[name] if recorded is None else recorded

    def generate(self, input_ids: "torch.Tensor", attention_mask: Optional["torch.Tensor"] = None, *,
                 max_new_tokens: Optional[int] = None, min_new_tokens: Optional[int] = None,
                 do_sample: Optional[bool] = None, temperature: Optional[float] = None, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, min_p: Optional[float] = None,
                 repetition_penalty: Optional[float] = None,
                 eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
                 streamer: Any = None) -> "torch.Tensor":
        """``input_ids`` [B, S] followed by the new tokens, as Hugging Face's one-beam ``generate`` makes them.

        An argument left None takes the checkpoint's generation config, then ``generate``'s default (20
        new tokens when no length is set anywhere, within the model's positions). Greedy, or with
        ``do_sample`` sampled after the temperature, top-k, top-p and min-p warpers (seed with
        ``torch.manual_seed``); a repetition penalty; rows that reach an end-of-sequence id are padded with
        ``pad_token_id`` (default: the first end id) until every row has ended. Left padding is given by
        ``attention_mask`` (never guessed from pad ids). ``streamer`` gets the prompt, each step's tokens,
        then ``end()``.
        """
        ids, mask = self._inputs(input_ids, attention_mask)
        length = ids.shape[1]
        new = self._setting("max_new_tokens", max_new_tokens)
        if new is None:
            longest = self._setting("max_length", None)
            if longest is None:
                positions = self.config.get("max_position_embeddings")
                longest = length + DEFAULT_NEW_TOKENS
                longest = min(longest, positions) if isinstance(positions, int) else longest
            new = longest - length
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise ValueError(f"xlaunch.llm.Decoder.generate: max_new_tokens must be at least 1, not {new!r}"
                             + ("" if max_new_tokens is not None else f" (the lengths set for a {length}-token prompt)"))
        least = self._setting("min_new_tokens", min_new_tokens)
        if isinstance(least, bool) or not isinstance(least, int) or least < 0:
            raise ValueError(f"xlaunch.llm.Decoder.generate: min_new_tokens must be a count >= 0, not {least!r}")
        shortest = self._setting("min_length", None)
        least = max(least, shortest - length) if isinstance(shortest, int) and min_new_tokens is None else least
        eos = _ids("eos_token_id", self._setting("eos_token_id", eos_token_id))
        pad = self._setting("pad_token_id", pad_token_id)
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
            raise ValueError(f"xlaunch.llm.Decoder.generate: pad_token_id must be one token id, not {pad!r}")
        if pad is None:      # generate's choice: the first end-of-sequence id (a row without one is never padded)
            pad = 0 if eos is None else int(eos[0])
        warpers = self._warpers(do_sample, temperature, top_k, top_p, min_p)
        penalty = _number("repetition_penalty", self._setting("repetition_penalty", repetition_penalty),
                          0.0, float("inf"), low_open=True)
        penalties = penalty_processors(penalty, mask)
        return self.runtime.generate_tokens(ids, mask, new, least, eos, pad, streamer, warpers, penalties)

    def _inputs(self, input_ids: Any, attention_mask: Any) -> tuple["torch.Tensor", Optional["torch.Tensor"]]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape \
                or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError("xlaunch.llm.Decoder.generate: input_ids must be a non-empty [batch, length] tensor of "
                             "token ids (torch.long)")
        ids = input_ids.long()
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise ValueError(f"xlaunch.llm.Decoder.generate: input_ids must be token ids below the vocabulary's "
                             f"{self.spec.vocab_size}")
        if attention_mask is None:
            return ids, None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != ids.shape \
                or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("xlaunch.llm.Decoder.generate: attention_mask must be 0s and 1s of input_ids' shape")
        return ids, attention_mask.long()

    def _warpers(self, do_sample: Optional[bool], temperature: Optional[float], top_k: Optional[int],
                 top_p: Optional[float], min_p: Optional[float]) -> Optional[list]:
        """Hugging Face's warpers for one beam, in its order and on its conditions; None: greedy."""
        if not self._setting("do_sample", do_sample):
            return None
        k = self._setting("top_k", top_k)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"xlaunch.llm.Decoder.generate: top_k must be a count >= 0, not {k!r}")
        least = self._setting("min_p", min_p)
        return sampling_warpers(
            _number("temperature", self._setting("temperature", temperature), 0.0, float("inf"), low_open=True), k,
            _number("top_p", self._setting("top_p", top_p), 0.0, 1.0),
            None if least is None else _number("min_p", least, 0.0, 1.0))


def load_decoder(path: Any, dtype: Any = None, weights: Optional[str] = None, group_size: Optional[int] = None,
                 private: bool = False, node_copy: bool = False) -> Decoder:
    """The decoder of a packed file (:func:`xlaunch.llm.save_packed`), mapped read-only and shared with every
    process that maps it; transformers is not imported. ``dtype``/``weights``/``group_size``, when given, must
    be the file's; ``private`` copies the weights into this process's 2 MiB pages instead; ``node_copy`` maps
    the copy of this process's NUMA node (:func:`xlaunch.node_copies.placed`: written once per node, shared by
    the node's processes; the file itself on a machine of one node). A file this machine cannot use, or one
    written before packed files recorded the decoder's shape, is one
    :class:`~xlaunch.llm.packed_file.PackedFileError` line."""
    path = user_path(path, "path", "xlaunch.llm.load_decoder")
    for name, value, allowed in (("dtype", dtype, (None, *DTYPES)), ("weights", weights, (None, "int8", "int4")),
                                 ("group_size", group_size, (None, *GROUP_SIZES))):
        if value not in allowed:        # not "the file holds another precision than the one asked for"
            raise ValueError(f"xlaunch.llm.load_decoder: {name} must be one of {allowed} (None: the file's), not {value!r}")
    mapped = placed(path) if node_copy else path
    runtime, manifest = load_runtime(mapped, dtype, weights, group_size, private)
    decoder = Decoder(runtime, manifest, Path(path))
    decoder.mapped = mapped
    return decoder
