"""The logits processing of one-beam ``generate``, for :meth:`~xlaunch.llm.decoder.DecoderRuntime.generate_tokens`.

Each function returns a callable ``(ids so far [B, T], scores [B, vocab]) -> scores``, the same values
Hugging Face's processors give (the tests compare tokens with its ``generate``): the repetition penalty,
then the temperature, top-k, top-p and min-p warpers, in :func:`warpers`' order and on its conditions.
Torch only: the optimized Hugging Face model and :mod:`xlaunch.llm.standalone` both use them.
"""
from __future__ import annotations

from typing import Callable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

Scores = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}      # generate's own, for what nothing sets
NEG_INF = -float("inf")


def temperature(value: float) -> Scores:
    return lambda ids, scores: scores / value


def top_k(k: int) -> Scores:
    """Only the ``k`` highest scores stay (ties with the k-th included)."""
    def warp(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        kth = torch.topk(scores, min(k, scores.size(-1)))[0][..., -1, None]
        return scores.masked_fill(scores < kth, NEG_INF)
    return warp


def top_p(p: float) -> Scores:
    """The most likely tokens whose probabilities add up to ``p`` stay (at least the most likely one)."""
    def warp(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        ordered, order = torch.sort(scores, descending=False)
        dropped = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - p)
        dropped[..., -1:] = False
        return scores.masked_fill(dropped.scatter(1, order, dropped), NEG_INF)
    return warp


def min_p(p: float) -> Scores:
    """Tokens at least ``p`` times as likely as the most likely one stay (that one always)."""
    def warp(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        probs = torch.softmax(scores, dim=-1)
        dropped = probs < p * probs.amax(dim=-1, keepdim=True)
        dropped.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        return scores.masked_fill(dropped, NEG_INF)
    return warp


def warpers(temperature_: Optional[float], top_k_: Optional[int], top_p_: Optional[float],
            min_p_: Optional[float]) -> list[Scores]:
    """The sampling warpers of one beam, None taking generate's default, each only where it changes anything."""
    value = DEFAULTS["temperature"] if temperature_ is None else temperature_
    chosen = [temperature(value)] if value != 1.0 else []
    k = DEFAULTS["top_k"] if top_k_ is None else top_k_
    if k != 0:
        chosen.append(top_k(k))
    p = DEFAULTS["top_p"] if top_p_ is None else top_p_
    if p < 1.0:
        chosen.append(top_p(p))
    if min_p_ is not None:
        chosen.append(min_p(min_p_))
    return chosen


def repetition_penalty(penalty: float, mask: Optional["torch.Tensor"]) -> list[Scores]:
    """Every token already in a row made less likely (a score divided by ``penalty``, a negative one multiplied),
    the row's left padding (``mask``'s leading zeros) left out; [] for a penalty of 1 or None."""
    if penalty is None or penalty == 1.0:
        return []
    padded = mask is not None and not bool((mask == 1).all())
    start = (mask != 0).int().argmax(dim=1) if padded else None

    def apply(ids: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        vocab = scores.shape[-1]
        if start is not None:
            ids = ids.masked_fill(torch.arange(ids.shape[1])[None, :] < start[:, None], vocab)
        ids = ids.clamp(max=vocab)                       # ids past the vocabulary land in a column dropped after
        widened = torch.nn.functional.pad(scores, (0, 1))
        seen = torch.gather(widened, 1, ids)
        seen = torch.where(seen < 0, seen * penalty, seen / penalty)
        return widened.scatter(1, ids, seen)[..., :vocab]
    return [apply]
