"""``xlaunch.llm.from_pretrained``: a checkpoint streamed straight into the packed layout.

The model is built from ``config.json`` on the meta device, so no full-precision weight is ever
held: each linear group (q/k/v, gate/up; o, down, lm_head alone) is read from the safetensors
file(s) (:mod:`xlaunch.llm.files.checkpoint`) a block of 64-row chunks at a time (read with ``pread``),
quantized and packed into its final buffer (2 MiB pages for the weights, as :class:`~xlaunch.llm.linear.PackedLinear`
makes them). The peak memory is the packed model plus one layer group's buffer and a few MiB.
The packed bytes are those :func:`xlaunch.llm.optimize` makes from the loaded model, bit for bit.
A path that is a packed file (:func:`xlaunch.llm.save_packed`) is mapped instead.
"""
from __future__ import annotations

import codecs
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from xlaunch import userfiles
from xlaunch._errors import flag, whole_number
from xlaunch._torch import needs_torch
from xlaunch.node_copies import placed

with needs_torch(__name__):
    import torch

from xlaunch.llm import footprint, native  # noqa: E402
from xlaunch.llm.api import _check, default_dtype, lm_head_packing, warn_if_bf16_is_slow  # noqa: E402
from xlaunch.llm.assemble import Parts, huge_empty, install, release_free_heap, skeleton  # noqa: E402
from xlaunch.llm.files import packed_target, quoted, user_path  # noqa: E402
from xlaunch.llm.files.checkpoint import (INDEX, SAFETENSORS_DTYPES, Checkpoint, SafetensorsFile,  # noqa: E402,F401
                                           WEIGHTS, source_digest)      # INDEX, SafetensorsFile, WEIGHTS: re-exported
from xlaunch.llm.decoder import SIXTEEN_BIT, embedding_table, exact_in_bf16  # noqa: E402
from xlaunch.llm.linear import (BLOCK, GROUPED, NATIVE_PACKERS, PackedLinear, bf16_valued, pack_bf16,  # noqa: E402
                                pack_channels, quantize)

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8,
                 "int6": torch.uint8}
CHUNK_BYTES = 1 << 20         # fp32 bytes of source rows packed at a time (small: glibc keeps freed chunks)
MAX_CONFIG = 16 << 20         # config.json, generation_config.json: a few KB


def _rows(checkpoint: Checkpoint, names: Sequence[str], start: int, stop: int) -> "torch.Tensor":
    """Rows [start, stop) of the weights ``names`` stacked along the output dimension."""
    pieces, offset = [], 0
    for name in names:
        n = checkpoint.shape(name)[0]
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            pieces.append(checkpoint.rows(name, lo - offset, hi - offset))
        offset += n
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _same_values(checkpoint: Checkpoint, first: str, second: str) -> bool:
    """Whether two stored tensors of one shape hold the same values (read a chunk of rows at a time)."""
    shape = checkpoint.shape(first)
    rows = shape[0] if shape else 1
    step = max(1, CHUNK_BYTES // (4 * max(1, math.prod(shape[1:]))))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if not torch.equal(checkpoint.rows(first, start, stop).float(), checkpoint.rows(second, start, stop).float()):
            return False
    return True


def _embedding(checkpoint: Checkpoint, name: str, dtype: "torch.dtype") -> "torch.Tensor":
    """:func:`~xlaunch.llm.decoder.embedding_table` of the stored table, cast a chunk of rows at a time (an fp32
    table cast to bf16 was read whole first: three times the bf16 table at once)."""
    source = SAFETENSORS_DTYPES.get(checkpoint.dtype(name))
    shape = checkpoint.shape(name)
    if source is None or len(shape) != 2:      # the dtype's one-line refusal (a shape is checked against the config)
        return embedding_table(checkpoint.tensor(name), dtype)
    step = max(1, CHUNK_BYTES // (4 * max(1, shape[1])))
    starts = range(0, shape[0], step)
    if dtype == torch.float32 and source in SIXTEEN_BIT:
        target = source
    elif dtype == torch.float32 and source == torch.float32:
        exact = all(exact_in_bf16(checkpoint.rows(name, start, min(shape[0], start + step))) for start in starts)
        target = torch.bfloat16 if exact else torch.float32
    else:
        target = dtype
    if target == source:
        return checkpoint.tensor(name)
    table = torch.empty(shape, dtype=target)
    for start in starts:
        table[start:start + step] = checkpoint.rows(name, start, min(shape[0], start + step)).to(target)
    return table


def _bias(checkpoint: Checkpoint, prefixes: Sequence[str], dtype: "torch.dtype") -> Optional["torch.Tensor"]:
    names = [f"{prefix}.bias" for prefix in prefixes]
    if not any(name in checkpoint for name in names):
        return None
    parts = [checkpoint.tensor(name) if name in checkpoint
             else torch.zeros(checkpoint.shape(f"{prefix}.weight")[0])
             for name, prefix in zip(names, prefixes)]
    return torch.cat([p.float() for p in parts]).to(dtype)


def _bf16_values(checkpoint: Checkpoint, names: Sequence[str], n: int, step: int) -> bool:
    """Whether the weights hold bf16 values only (a bf16 checkpoint's): fp32 layers of such weights are stored as bf16
    in the native layout, as :class:`PackedLinear` does. BF16 tensors are not read; others a chunk at a time."""
    return all(checkpoint.dtype(name) == "BF16" for name in names) or all(
        bf16_valued(_rows(checkpoint, names, start, min(n, start + step)).float()) for start in range(0, n, step))


def stream_linear(checkpoint: Checkpoint, prefixes: Sequence[str], kind: str, dtype: "torch.dtype",
                  group_size: int, weight_names: Optional[Sequence[str]] = None) -> PackedLinear:
    """One :class:`PackedLinear` of the linears ``prefixes`` (their outputs concatenated), packed by chunks."""
    names = list(weight_names or [f"{prefix}.weight" for prefix in prefixes])
    n = sum(checkpoint.shape(name)[0] for name in names)
    k = checkpoint.shape(names[0])[1]
    bias = _bias(checkpoint, prefixes, dtype)
    step = max(BLOCK, CHUNK_BYTES // (4 * k) // BLOCK * BLOCK)
    native_bf16 = kind == "fp32" and native.ops() is not None and _bf16_values(checkpoint, names, n, step)
    layout = "native" if (kind != "fp32" or native_bf16) and native.ops() is not None else "aten"
    if kind in GROUPED and k % group_size:
        raise ValueError(f"xlaunch.llm.from_pretrained: in_features {k} of {prefixes[0]} is not a multiple of "
                         f"the {kind.upper()} group size {group_size}")
    if layout == "aten" and kind in GROUPED:      # packed whole, as optimize does
        layer = PackedLinear(_rows(checkpoint, names, 0, n), bias, kind, dtype=dtype, group_size=group_size)
        release_free_heap()     # the whole weight's read and its copies
        return layer
    shapes = footprint.packed_shapes(kind, layout, n, k, group_size)      # fp32, bf16 and int8 (aten), or any (native)
    stored = torch.bfloat16 if kind == "fp32" and layout == "native" else WEIGHT_DTYPES[kind]    # bf16 values
    weight = huge_empty(shapes["weight"], stored)
    scales = torch.empty(shapes["scales"], dtype=torch.float32) if "scales" in shapes else None
    with torch.no_grad():
        for start in range(0, n, step):
            rows = _rows(checkpoint, names, start, min(n, start + step))
            where = slice(start // BLOCK, start // BLOCK + -(-rows.shape[0] // BLOCK)) if layout == "native" \
                else slice(start, start + rows.shape[0])
            if kind in ("bf16", "fp32"):
                weight[where] = pack_bf16(rows) if layout == "native" else rows.to(weight.dtype)
                continue
            q, scale = quantize(kind, rows, group_size)
            if layout == "aten":
                weight[where], scales[where] = q, scale
            else:
                weight[where] = NATIVE_PACKERS[kind](q)
                scales[where] = pack_channels(scale)
    release_free_heap()     # this layer's chunks, before the next one's
    return PackedLinear.from_packed(weight, scales, bias, kind, dtype, group_size, n, k, layout)


def load_checkpoint(path: Any, dtype: Any = None, weights: Optional[str] = None, group_size: int = 128) -> Any:
    """The optimized model of a safetensors checkpoint directory, streamed (see the module docstring)."""
    import transformers

    dtype = default_dtype() if dtype is None else dtype
    kind = _check(dtype, weights, group_size, "xlaunch.llm.from_pretrained")
    path = _path(path, "path")
    checkpoint = Checkpoint(path)
    try:
        config, generation = _config(path), _generation_config(path)     # before any weight is read
        try:    # what save_packed records: the files as read now, not as they are when it is called
            digest = source_digest(path)
        except userfiles.UserFileError as error:
            raise ValueError(f"xlaunch.llm.from_pretrained: {error}") from None
        model, spec, parts = _read(checkpoint, config, kind, dtype, group_size)
    finally:
        checkpoint.close()
    if generation is not None:
        model.generation_config = generation
    model = install(model, spec, dtype, parts)
    object.__setattr__(model, "_xlaunch_llm_source", os.path.abspath(path))   # save_packed records it (after a chdir)
    object.__setattr__(model, "_xlaunch_llm_source_digest", digest)
    return model


def _bounded(file: Path) -> bytes:
    """The bytes of ``file``, or one ValueError line unless it is a regular file of at most :data:`MAX_CONFIG` bytes
    (transformers reads a config whole: a runaway or corrupt file of gigabytes was read into memory)."""
    try:
        return userfiles.read_user_file(str(file), limit=MAX_CONFIG)
    except userfiles.UserFileError as error:
        raise ValueError(f"xlaunch.llm.from_pretrained: {error}") from None


def _config(path: Path) -> Any:
    """The checkpoint's config as transformers reads it; whatever transformers raises on a malformed one
    (its validation errors, a model type it does not know: several lines) is one ValueError line."""
    import transformers

    file = path / "config.json"
    loaded, problem = _json(_bounded(file))
    if problem is not None:
        raise ValueError(f"xlaunch.llm.from_pretrained: {file} {problem}")
    if not isinstance(loaded, dict):    # transformers said "Unrecognized model" or "'int' is not iterable"
        what = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(loaded), "a number")
        raise ValueError(f"xlaunch.llm.from_pretrained: {file} holds {what}, not a JSON object")
    try:
        return transformers.AutoConfig.from_pretrained(str(path))
    except Exception as error:      # noqa: BLE001 - the user's file, read by another library
        raise ValueError(f"xlaunch.llm.from_pretrained: {file} is not a config transformers "
                         f"can use ({quoted(error)})") from None


def _json(data: bytes) -> tuple[Any, Optional[str]]:
    """(the JSON value of a config file, None), or (None, what keeps transformers from reading it)."""
    if data.startswith(codecs.BOM_UTF8):      # Windows editors write one; transformers: "not a valid JSON file"
        return None, "begins with a UTF-8 byte-order mark, which transformers does not read (save it without one)"
    try:
        return json.loads(data), None
    except (ValueError, RecursionError) as error:
        return None, f"is not JSON ({quoted(error)})"


def _generation_config(path: Path) -> Any:
    """The folder's generation config, or None (none there; not JSON: skipped, as transformers' own load does,
    with a warning naming it where transformers says nothing); one it refuses (``max_new_tokens: -1``...) is one
    ValueError line naming the file, and so is one that is not a regular file (a FIFO, a directory, a dangling
    link: transformers' load skipped them silently)."""
    import transformers

    file = path / "generation_config.json"
    if not os.path.lexists(file):
        return None
    _, problem = _json(_bounded(file))
    try:
        if problem is not None:
            raise OSError(problem)
        return transformers.GenerationConfig.from_pretrained(str(path))
    except OSError as error:
        warnings.warn(f"xlaunch.llm.from_pretrained: {file} {problem or quoted(error)}: skipped, as transformers "
                      "skips it (generate uses what config.json gives)", UserWarning, stacklevel=4)
        return None
    except Exception as error:      # noqa: BLE001 - the user's file, read by another library
        raise ValueError(f"xlaunch.llm.from_pretrained: {file} is not a generation config "
                         f"transformers can use ({quoted(error)})") from None


def _path(value: Any, name: str) -> Path:
    return user_path(value, name, "xlaunch.llm.from_pretrained")


def _check_tensors(checkpoint: Checkpoint, model: Any, spec: Any, config: Any) -> tuple[str, bool]:
    """(the tensor lm_head is packed from, whether the embedding is tied to it), once every tensor the model reads
    is found stored in a float dtype and of its config's shape: one line before anything is packed (a tensor
    missing from the last layer was found after every layer before it was packed)."""
    path = checkpoint.path
    method = getattr(config, "quantization_config", None)
    method = method.get("quant_method", "pre") if isinstance(method, dict) else getattr(method, "quant_method", None)
    hint = "" if method is None else (f" (its weights are quantized by {method}: xlaunch.llm quantizes full-precision "
                                      "weights itself; load the original checkpoint with weights='int8' or 'int4')")
    expected = {name: list(parameter.shape) for name, parameter in model.named_parameters()}     # meta: no memory
    expected.setdefault("lm_head.weight", expected.get("model.embed_tokens.weight"))      # tied, stored anyway
    head = "lm_head.weight" if "lm_head.weight" in checkpoint else "model.embed_tokens.weight"
    architectures = getattr(config, "architectures", None) or []      # a classifier's or a base model's checkpoint
    causal = not architectures or any(str(name).endswith("ForCausalLM") for name in architectures)
    if head != "lm_head.weight" and not spec.tied_embeddings and not causal:
        raise ValueError(f"xlaunch.llm.from_pretrained: {path} holds a {architectures[0]} (its config.json's "
                         f"architectures), not a causal LM: it stores no lm_head.weight{hint}")
    if head != "lm_head.weight" and not spec.tied_embeddings:
        # transformers loads it, lm_head random (a "MISSING" line in its load report): text from noise
        raise ValueError(f"xlaunch.llm.from_pretrained: {path} lacks the tensor lm_head.weight, and its config.json "
                         "does not tie lm_head to the embedding (tie_word_embeddings is not true): transformers would "
                         "fill it with random values; if lm_head is the embedding, set \"tie_word_embeddings\": true "
                         f"in config.json{hint}")
    for name, shape in expected.items():
        if name not in checkpoint:
            tied_other = spec.tied_embeddings and name in ("lm_head.weight", "model.embed_tokens.weight")
            if name.endswith(".bias") or (tied_other and name != head):   # zeros (as transformers makes it); tied
                continue
            raise ValueError(f"xlaunch.llm.from_pretrained: {path} lacks the tensor {name}{hint}")
        if checkpoint.dtype(name) not in SAFETENSORS_DTYPES:
            raise ValueError(f"xlaunch.llm.from_pretrained: {name} in {path} is {checkpoint.dtype(name)}, not one of "
                             f"{', '.join(SAFETENSORS_DTYPES)}{hint}")
        if checkpoint.shape(name) != shape:
            raise ValueError(f"xlaunch.llm.from_pretrained: {name} in {path} is {checkpoint.shape(name)}, "
                             f"not the {shape} of its config.json{hint}")
    # stored, not read (a config of fewer layers than stored, biases the config turns off): transformers lists them
    # (UNEXPECTED in its load report) and so do we, but for the buffers it skips too
    unread = sorted(name for name in checkpoint.weight_map
                    if name not in expected and not name.endswith(("rotary_emb.inv_freq", "position_ids")))
    if unread:
        warnings.warn(f"xlaunch.llm.from_pretrained: {path} stores {len(unread)} tensor(s) the model of its "
                      f"config.json does not read, not loaded (as transformers does): {', '.join(unread[:3])}"
                      f"{', ...' if len(unread) > 3 else ''}", UserWarning, stacklevel=5)
    # tied, but both stored with different values: transformers does not tie them (a warning), and neither do we
    tied = spec.tied_embeddings and (head != "lm_head.weight" or "model.embed_tokens.weight" not in checkpoint
                                     or _same_values(checkpoint, head, "model.embed_tokens.weight"))
    if spec.tied_embeddings and not tied:
        warnings.warn(f"xlaunch.llm.from_pretrained: {path} ties its embeddings (tie_word_embeddings), but stores "
                      "lm_head.weight and model.embed_tokens.weight with different values: not tied, as transformers "
                      "does", UserWarning, stacklevel=5)
    return head, tied


def _read(checkpoint: Checkpoint, config: Any, kind: str, dtype: "torch.dtype", group_size: int) -> tuple:
    """(meta model, spec, packed parts) of a checkpoint."""
    model, spec = skeleton(config)
    head, tied = _check_tensors(checkpoint, model, spec, config)
    linears, input_norms, post_norms = [], [], []
    for index in range(spec.num_layers):
        prefix = f"model.layers.{index}"
        attention, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        pack = dict(kind=kind, dtype=dtype, group_size=group_size)
        linears.append({
            "qkv": stream_linear(checkpoint, [f"{attention}.{p}_proj" for p in "qkv"], **pack),
            "out": stream_linear(checkpoint, [f"{attention}.o_proj"], **pack),
            "gate_up": stream_linear(checkpoint, [f"{mlp}.gate_proj", f"{mlp}.up_proj"], **pack),
            "down": stream_linear(checkpoint, [f"{mlp}.down_proj"], **pack),
        })
        input_norms.append(checkpoint.tensor(f"{prefix}.input_layernorm.weight").to(dtype))
        post_norms.append(checkpoint.tensor(f"{prefix}.post_attention_layernorm.weight").to(dtype))
    head_kind, head_group = lm_head_packing(kind, checkpoint.shape(head)[1], group_size)
    lm_head = stream_linear(checkpoint, ["lm_head"], head_kind, dtype, head_group, weight_names=[head])
    embed = None if tied else _embedding(checkpoint, "model.embed_tokens.weight", dtype)
    release_free_heap()     # the embedding's read (and its cast)
    parts = Parts(embed=embed,
                  final_norm=checkpoint.tensor("model.norm.weight").to(dtype), lm_head=lm_head,
                  input_norms=input_norms, post_attention_norms=post_norms, linears=linears)
    return model, spec, parts


def from_pretrained(path: Any, dtype: Any = None, weights: Optional[str] = None, group_size: int = 128,
                    source: Any = None, private: bool = False, node_copy: bool = False) -> Any:
    """An optimized Hugging Face Llama, Mistral or Qwen2 causal LM, loaded without its full-precision copy.

    ``path``: a checkpoint directory (``config.json`` and ``*.safetensors``, sharded or not), streamed
    into the packed layout of ``dtype``/``weights``/``group_size`` (as :func:`xlaunch.llm.optimize`);
    or a packed file written by :func:`xlaunch.llm.save_packed`, mapped read-only and shared between
    processes (``private=True`` copies it into this process's 2 MiB pages instead; ``node_copy=True`` maps
    the copy of this process's NUMA node, :func:`xlaunch.node_copies.placed`). With ``source``
    (a checkpoint directory), ``path`` is the packed file of that source: written when missing,
    rewritten when stale (another source, kernel level, layout or precision), then mapped.
    A bf16 ``dtype`` on a CPU without native bf16 gets one warning, as in :func:`xlaunch.llm.optimize`.
    """
    from xlaunch.llm import packed_file

    # the arguments first: a packed file's refusal read dtype="float32" as another precision than the file's
    caller = "xlaunch.llm.from_pretrained"
    group_size = whole_number(group_size, f"{caller}: group_size", minimum=None)   # "128": a TypeError mid-stream
    private, node_copy = flag(private, f"{caller}: private"), flag(node_copy, f"{caller}: node_copy")
    _check(default_dtype() if dtype is None else dtype, weights, group_size, caller)
    warn_if_bf16_is_slow(dtype, "xlaunch.llm.from_pretrained", stacklevel=2)
    path = _path(path, "path")
    if source is not None:
        source = _path(source, "source")
        if dtype is None:
            dtype = default_dtype()
        if packed_file.stale_reason(path, source, dtype, weights, group_size) is not None:
            problem = packed_target(path)   # before the checkpoint is streamed (minutes), not after
            if problem is not None:
                raise packed_file.PackedFileError(f"xlaunch.llm.save_packed: {problem}")
            packed_file.save_packed(load_checkpoint(source, dtype, weights, group_size), path, source=source)
        group: Optional[int] = group_size
    elif path.is_dir():
        return load_checkpoint(path, dtype, weights, group_size)
    else:
        group = group_size if weights == "int4" else None
    return packed_file.load_packed(placed(path) if node_copy else path, dtype, weights, group, private=private)
