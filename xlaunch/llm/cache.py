"""A preallocated KV cache that ``model.generate`` carries like its own caches.

One buffer per layer and per K/V, ``[batch, kv_heads, capacity, head_dim]`` in the model's dtype,
filled slot by slot: decoding writes one slot per token and never reallocates; the buffers are left
uninitialized, so their pages are committed as slots are written. The capacity is
``generate``'s maximum length when :func:`xlaunch.llm.optimize` could read it; a direct call that
outgrows it doubles the buffers (one copy), as does one whose maximum cannot be allocated at all.

:class:`KVBuffers` is the cache itself and needs only torch (:mod:`xlaunch.llm.standalone` decodes with it,
transformers never imported). :class:`KVCache` adds Hugging Face's ``Cache`` interface to it, so ``generate``
treats it as a cache (sequence length, beam reordering, cropping) while the optimized forward reads the
buffers directly; the class is made on first use, the first time transformers is needed.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

LLM_EXTRA = 'pip install "xlaunch[llm]"'


@contextlib.contextmanager
def needs_transformers(what: str) -> Iterator[None]:
    """Around a module's transformers imports: missing, it says which extra brings it."""
    try:
        yield
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "transformers":
            raise
        raise ImportError(f"{what} needs transformers: {LLM_EXTRA}", name="transformers") from exc


MIN_CAPACITY = 64


class KVBuffers:
    """Static K/V buffers for every layer, filled to :attr:`length` slots.

    ``padding`` ([batch, length] bool, or None when no slot is padding) records which slots hold
    left padding, from the attention mask ``generate`` passes.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: "torch.dtype",
                 capacity: int = 0) -> None:
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.capacity_hint = max(int(capacity), 0)
        self.keys: list["torch.Tensor"] = []
        self.values: list["torch.Tensor"] = []
        self.length = 0
        self.padding: Optional["torch.Tensor"] = None

    # --- what the optimized forward uses -------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def reserve(self, batch: int, needed: int) -> None:
        """Make room for ``needed`` slots of ``batch`` rows (allocating on first use, doubling after)."""
        if self.keys and batch != self.batch:
            raise ValueError(f"this KV cache holds a batch of {self.batch}, not {batch}: start a new one "
                             "(past_key_values=None) for another batch")
        if self.keys and needed <= self.capacity:
            return
        grown = max(needed, MIN_CAPACITY, 2 * self.capacity)
        if self.capacity_hint and not self.keys:      # generate's maximum length: exactly that
            try:
                new_keys, new_values = self._buffers(batch, max(needed, self.capacity_hint))
            except RuntimeError:    # more address space than the host gives (max_new_tokens=10**9): grow instead
                self.capacity_hint = 0
                new_keys, new_values = self._buffers(batch, grown)
        else:
            new_keys, new_values = self._buffers(batch, grown)
        for old, new in zip(self.keys + self.values, new_keys + new_values):
            new[:, :, : self.length].copy_(old[:, :, : self.length])
        self.keys, self.values = new_keys, new_values

    def _buffers(self, batch: int, capacity: int) -> tuple[list["torch.Tensor"], list["torch.Tensor"]]:
        """New key and value buffers of ``capacity`` slots. Uninitialized: only the first ``length`` slots are ever
        read, and the pages of a large buffer are committed as decoding writes them (generate's maximum is a bound,
        not what a reply takes)."""
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        return ([torch.empty(shape, dtype=self.dtype) for _ in range(self.num_layers)],
                [torch.empty(shape, dtype=self.dtype) for _ in range(self.num_layers)])

    def note_padding(self, attention_mask: Optional["torch.Tensor"], total: int) -> Optional["torch.Tensor"]:
        """Record which of the first ``total`` slots are padding (zeros in the mask's first ``total`` columns, as
        transformers reads a mask longer than the cache and input); returns [batch, total] or None."""
        if attention_mask is None:       # a continuation: the padding recorded so far
            return self.padding[:, :total] if self.padding is not None and self.padding.shape[1] >= total else None
        if attention_mask.shape[1] < total:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} tokens, the cache and input {total}")
        mask = attention_mask[:, :total] == 0      # slot j is column j (a longer mask: its first columns, as transformers)
        self.padding = mask if bool(mask.any()) else None
        return self.padding

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` slots, as Hugging Face's caches do (transformers 5: a negative
        count, 0 a no-op; a positive one is refused, as its layers refuse it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"KV cache crop({tokens_to_remove}): pass a negative count of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.padding is not None:
            self.padding = self.padding[:, : self.length]

    def reset(self) -> None:
        self.length, self.padding = 0, None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={self.num_layers}, batch={self.batch}, length={self.length}, "
                f"capacity={self.capacity}, dtype={self.dtype})")


@functools.lru_cache(maxsize=1)
def hf_cache_class() -> type:
    """``KVCache``: :class:`KVBuffers` that is also Hugging Face's ``Cache`` (transformers imported here, once)."""
    with needs_transformers("xlaunch.llm"):
        from transformers.cache_utils import Cache

    class KVCache(KVBuffers, Cache):
        """xlaunch.llm's K/V buffers with Hugging Face's ``Cache`` interface, which ``generate`` carries."""

        def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: "torch.dtype",
                     capacity: int = 0) -> None:
            Cache.__init__(self, layers=[])
            KVBuffers.__init__(self, num_layers, kv_heads, head_dim, dtype, capacity)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.length

        def get_max_length(self, layer_idx: Optional[int] = None) -> int:
            return self.capacity

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return self.length + query_length, 0

        @property
        def is_compileable(self) -> bool:     # generate must not compile or build 4-D masks for it
            return False

        @property
        def is_initialized(self) -> bool:
            return bool(self.keys)

        @property
        def is_croppable(self) -> bool:
            return True

        @property
        def batch_size(self) -> int:
            return self.batch if self.keys else -1

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            raise RuntimeError("xlaunch.llm's KV cache is filled by the optimized forward only; "
                               "call the optimized model itself, not its layers")

        def _select_rows(self, index: "torch.Tensor") -> None:
            """Rows ``index`` of the written slots (beam search reorders every step: copying the whole capacity,
            generate's maximum length, cost a step seconds and committed every page of the buffers)."""
            length, rows = self.length, index.numel()

            def select(buffer: "torch.Tensor") -> "torch.Tensor":
                chosen = buffer[:, :, :length].index_select(0, index)
                kept = buffer if rows == buffer.shape[0] else buffer.new_empty((rows, *buffer.shape[1:]))
                kept[:, :, :length].copy_(chosen)
                return kept

            self.keys, self.values = [select(k) for k in self.keys], [select(v) for v in self.values]
            if self.padding is not None:
                self.padding = self.padding.index_select(0, index)

        def reorder_cache(self, beam_idx: "torch.LongTensor") -> None:
            if self.keys:
                self._select_rows(beam_idx.to(torch.long))

        def batch_select_indices(self, indices: "torch.Tensor") -> None:
            if self.keys:
                self._select_rows(indices.to(torch.long))

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.keys:
                self._select_rows(torch.arange(self.batch).repeat_interleave(repeats))

    KVCache.__module__, KVCache.__qualname__ = __name__, "KVCache"     # found again as xlaunch.llm.cache.KVCache
    return KVCache


def __getattr__(name: str) -> Any:
    if name == "KVCache":
        return hf_cache_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
