"""One file of packed weights, mapped read-only: :func:`save_packed` and :func:`load_packed`.

Layout: ``XLLMPACK`` (8 bytes), the manifest's length (8 bytes, little endian), the manifest (JSON:
format version, the model's config and generation config, the decoder's shape and RoPE scaling,
precision, the kernel level and a fingerprint of the packed layout, the source checkpoint's digest,
every packed linear and every tensor's dtype/shape/offset/length), then the tensors, each at an
offset aligned to 4 KiB (2 MiB from 2 MiB up), the RoPE's inverse frequencies among them.

Loading maps the file read-only (``mmap``) and wraps the tensors in place: no copy, so loading takes
milliseconds and processes that map one file share one copy of its pages in the page cache.
:func:`load_packed` gives the Hugging Face model back; :func:`load_runtime` the runtime alone, with
neither transformers nor its config classes imported (a file written before the decoder's shape was
recorded loads only the first way). A file of another format version, kernel level or layout is
refused with one line (``from_pretrained(path, source=CHECKPOINT)`` rewrites it instead); a malformed
or truncated file gets one error, and nothing outside the file is read.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import mmap
import os
import stat
import struct
import warnings
from pathlib import Path
from typing import Any, Optional

from xlaunch import userfiles
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

from xlaunch.llm import footprint, native  # noqa: E402
from xlaunch.llm.assemble import (HUGE_PAGE, LAYER_LINEARS, Parts, huge_empty, install, parts_of,  # noqa: E402
                                  runtime_of, skeleton)
from xlaunch.llm.files import (checkpoint, packed_target, quoted, remove_killed_writers_files,  # noqa: E402
                                user_path)
from xlaunch.llm.decoder import DTYPES, SIXTEEN_BIT, DecoderRuntime, RopeTable  # noqa: E402
from xlaunch.llm.linear import GROUP_SIZES, GROUPED, KINDS, PackedLinear  # noqa: E402
from xlaunch.llm.shapes import DecoderSpec, record_spec  # noqa: E402

MAGIC = b"XLLMPACK"
FORMAT_VERSION = 2   # 2: INT8 weights [N/64, K/4, 64 x 4] (was [N/64, K, 64])
MAX_HEADER = 64 << 20
PAGE = 4096
SOURCE_ATTR, DIGEST_ATTR = "_xlaunch_llm_source", "_xlaunch_llm_source_digest"   # set by the loaders
TENSOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int8": torch.int8,
                 "uint8": torch.uint8, "int32": torch.int32}
MAX_LAYERS = 4096
WEIGHT_DTYPES = {"fp32": ("float32",), "bf16": ("bfloat16",), "int8": ("int8",), "int4": ("uint8", "int32"),
                 "int6": ("uint8", "int8")}


class PackedFileError(ValueError):
    """A packed file that cannot be used here (the message is one line)."""


def kernel_level() -> str:
    """The ISA level of the kernels this process runs (``xlaunch.llm.native``'s, capped by
    ``XLAUNCH_CPU_ISA``), or ``"aten"`` without them: what the packed layout depends on."""
    return (native.LIBRARY.level() or "aten") if native.ops() is not None else "aten"


def expected_layouts(kind: str) -> tuple[str, ...]:
    """The layouts a model of ``kind`` has here: fp32 is native only where its values are bf16 values."""
    if native.ops() is None:
        return ("aten",)
    return ("native", "aten") if kind == "fp32" else ("native",)


@functools.lru_cache(maxsize=None)
def layout_fingerprint() -> str:
    """A hash of how this machine packs a fixed probe weight in every precision: changes with the layout."""
    probe = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    digest = hashlib.sha256()
    for kind, group in (("fp32", 128), ("bf16", 128), ("int8", 128), ("int4", 32), ("int6", 64)):
        layer = PackedLinear(probe, None, kind, dtype=torch.bfloat16, group_size=group)
        for tensor in (layer.weight, layer.scales):
            if tensor is not None:
                digest.update(f"{kind}:{layer.layout}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def source_digest(path: Any) -> str:
    """:func:`xlaunch.llm.files.checkpoint.source_digest`; a file it may not read is one :class:`PackedFileError`."""
    try:
        return checkpoint.source_digest(path)
    except userfiles.UserFileError as error:
        raise PackedFileError(f"xlaunch.llm: the checkpoint {path}: {error}") from None


def _digest_of(model: Any, source: Any) -> str:
    """The digest the loader took of ``source`` when it read the model from it (what the model holds, should the
    folder have changed or gone since); another source's, read now."""
    recorded = getattr(model, DIGEST_ATTR, None)
    if isinstance(recorded, str) and os.path.abspath(source) == getattr(model, SOURCE_ATTR, None):
        return recorded
    return source_digest(source)


def _align(offset: int, nbytes: int) -> int:
    unit = HUGE_PAGE if nbytes >= HUGE_PAGE else PAGE
    return -(-offset // unit) * unit


def _linear_entries(name: str, layer: PackedLinear, tensors: dict) -> dict:
    entry = dict(kind=layer.kind, layout=layer.layout, out_features=layer.out_features,
                 in_features=layer.in_features, group_size=layer.group_size)
    for part in ("weight", "scales", "bias"):
        tensor = getattr(layer, part)
        entry[part] = None if tensor is None else f"{name}.{part}"
        if tensor is not None:
            tensors[f"{name}.{part}"] = tensor
    return entry


def save_packed(model: Any, path: Any, source: Any = None) -> Path:
    """Write an optimized model's packed weights to one file at ``path`` (replaced atomically); returns it.

    ``source``: the checkpoint directory the model came from (default: the one
    :func:`~xlaunch.llm.from_pretrained` loaded it from, if any); its digest is recorded, so
    ``from_pretrained(path, source=...)`` notices a changed checkpoint.
    """
    runtime, parts = parts_of(model)
    spec, dtype = runtime.spec, runtime.dtype
    source = source if source is not None else getattr(model, SOURCE_ATTR, None)
    tensors: dict[str, "torch.Tensor"] = {"final_norm": parts.final_norm, "rope.inv_freq": runtime.rope.inv_freq}
    if parts.embed is not None:          # else tied: the embedding is lm_head's rows
        tensors["embed"] = parts.embed
    linears = {"lm_head": _linear_entries("lm_head", parts.lm_head, tensors)}
    for index, layer in enumerate(parts.linears):
        tensors[f"layers.{index}.input_norm"] = parts.input_norms[index]
        tensors[f"layers.{index}.post_attention_norm"] = parts.post_attention_norms[index]
        for name in LAYER_LINEARS:
            linears[f"layers.{index}.{name}"] = _linear_entries(f"layers.{index}.{name}", layer[name], tensors)
    first = parts.linears[0]["qkv"]
    generation = getattr(model, "generation_config", None)
    manifest = dict(format="xlaunch.llm.packed", version=FORMAT_VERSION, architecture=spec.architecture,
                    config=model.config.to_dict(), generation_config=generation.to_dict() if generation else None,
                    decoder=dataclasses.asdict(spec), rope=dict(attention_scaling=runtime.rope.attention_scaling),
                    dtype=DTYPES[dtype], weights=first.kind, group_size=first.group_size,
                    kernel=dict(level=kernel_level(), layout=first.layout, fingerprint=layout_fingerprint()),
                    source=None if source is None else dict(path=str(source), digest=_digest_of(model, source)),
                    embedding="table" if parts.embed is not None else "lm_head", linears=linears, tensors={})
    # offsets depend on the manifest's length: reserve room for the offsets' digits, then lay out
    entries = {name: dict(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                          nbytes=t.numel() * t.element_size()) for name, t in tensors.items()}
    manifest["tensors"] = {name: dict(entry, offset=10 ** 15) for name, entry in entries.items()}
    header_room = _align(16 + len(json.dumps(manifest).encode()), PAGE) + PAGE
    offset = header_room
    for name, entry in entries.items():
        offset = _align(offset, entry["nbytes"])
        manifest["tensors"][name] = dict(entry, offset=offset)
        offset += entry["nbytes"]
    header = json.dumps(manifest).encode()
    path = user_path(path, "path", "xlaunch.llm.save_packed")
    problem = packed_target(path)
    if problem is not None:
        raise PackedFileError(f"xlaunch.llm.save_packed: {problem}")
    remove_killed_writers_files(path)
    partial = None
    try:    # a new file of its own (O_EXCL, O_NOFOLLOW, a random name): one per writer, threads of a process too
        fd, partial = userfiles.new_file(str(path.parent), f"{path.name}.{os.getpid()}")
        with os.fdopen(fd, "wb") as handle:
            handle.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for name, tensor in tensors.items():
                handle.seek(manifest["tensors"][name]["offset"])
                handle.write(tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy())
            handle.truncate(offset)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except OSError as error:    # no such or a read-only folder, a full disk: one line naming the file asked for
        raise PackedFileError(f"xlaunch.llm.save_packed: cannot write {path} ({error.strerror or error})") from None
    finally:
        if partial is not None and os.path.lexists(partial):
            os.unlink(partial)
    return path


def _fail(path: Any, problem: str) -> PackedFileError:
    return PackedFileError(f"xlaunch.llm: {path}: {problem}")


def _read_manifest(path: Any) -> tuple[dict, int, int]:
    """(manifest, open read-only fd, file size) of a packed file, its tensors checked against the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))   # a FIFO must not block
    except OSError as exc:
        hub = not os.path.isabs(path) and str(path).count("/") == 1 and isinstance(exc, FileNotFoundError)
        raise _fail(path, f"cannot open the packed file ({exc.strerror})" + (
            "; a Hugging Face Hub name is not downloaded: xlaunch.llm reads local files only" if hub else "")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _fail(path, "not a regular file")
        size = info.st_size
        prefix = os.pread(fd, 16, 0)
        if len(prefix) < 16 or prefix[:8] != MAGIC:
            own = "; from_pretrained takes the checkpoint's folder" if str(path).endswith((".safetensors", ".json")) else ""
            raise _fail(path, f"not an xlaunch packed-weights file (no XLLMPACK header){own}")
        length = struct.unpack("<Q", prefix[8:])[0]
        if length > MAX_HEADER or 16 + length > size:
            raise _fail(path, f"truncated or malformed: a {length}-byte manifest in a {size}-byte file")
        try:
            manifest = json.loads(os.pread(fd, length, 16))
        except ValueError:
            raise _fail(path, "the manifest is not valid JSON") from None
        if not isinstance(manifest, dict) or manifest.get("format") != "xlaunch.llm.packed":
            raise _fail(path, "the manifest is not an xlaunch.llm packed-weights manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise _fail(path, f"written in format version {manifest.get('version')!r}, this xlaunch reads version "
                              f"{FORMAT_VERSION}; rebuild it: from_pretrained(path, source=CHECKPOINT)")
        _check_tensors(path, manifest.get("tensors"), 16 + length, size)
        return manifest, fd, size
    except BaseException:
        os.close(fd)
        raise


def _check_tensors(path: Any, tensors: Any, data_start: int, size: int) -> None:
    if not isinstance(tensors, dict):
        raise _fail(path, "the manifest has no tensor table")
    spans = []
    for name, entry in tensors.items():
        try:
            dtype = TENSOR_DTYPES[entry["dtype"]]
            shape, offset, nbytes = entry["shape"], entry["offset"], entry["nbytes"]
            ok = (all(type(d) is int and d >= 0 for d in shape) and type(offset) is int and type(nbytes) is int
                  and nbytes == torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size())
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError):
            ok = False
        if not ok:
            raise _fail(path, f"malformed manifest entry for tensor {name!r}")
        if offset < data_start or offset % PAGE:
            raise _fail(path, f"tensor {name!r} starts at {offset}, inside the header or unaligned")
        if offset + nbytes > size:
            raise _fail(path, f"truncated: tensor {name!r} ends at byte {offset + nbytes}, the file has {size}")
        if nbytes:
            spans.append((offset, offset + nbytes, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise _fail(path, f"tensors {first!r} and {second!r} overlap (malformed manifest)")


def _expected_linears(spec: Any) -> dict:
    heads, kv, dim, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    per_layer = {"qkv": ((heads + 2 * kv) * dim, hidden), "out": (hidden, heads * dim),
                 "gate_up": (2 * spec.intermediate_size, hidden), "down": (hidden, spec.intermediate_size)}
    shapes = {"lm_head": (spec.vocab_size, hidden)}
    for index in range(spec.num_layers):
        shapes.update({f"layers.{index}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def _tensor(area: mmap.mmap, entry: dict, private: bool) -> "torch.Tensor":
    dtype = TENSOR_DTYPES[entry["dtype"]]
    count = torch.Size(entry["shape"]).numel()
    if count == 0:
        return torch.empty(entry["shape"], dtype=dtype)
    with warnings.catch_warnings():     # the mapping is read-only, and so are these tensors
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(area, dtype=dtype, count=count, offset=entry["offset"]).reshape(entry["shape"])
    if private:
        return huge_empty(tensor.shape, dtype).copy_(tensor)
    return tensor


def _linear(path: Any, name: str, entry: Any, shape: tuple, area: mmap.mmap, tensors: dict, dtype: Any,
            private: bool) -> PackedLinear:
    try:
        kind, layout, n, k, group = (entry["kind"], entry["layout"], entry["out_features"], entry["in_features"],
                                     entry["group_size"])
        parts = {part: entry[part] for part in ("weight", "scales", "bias")}
    except (KeyError, TypeError):
        raise _fail(path, f"malformed manifest entry for the linear {name!r}") from None
    if (kind not in KINDS or layout not in ("native", "aten") or (n, k) != shape or type(group) is not int
            or (kind in GROUPED and (group not in GROUP_SIZES or k % group))):
        raise _fail(path, f"the linear {name!r} does not match the model's config")
    wanted = dict(footprint.packed_shapes(kind, layout, n, k, group), bias=[n])
    weight_dtypes = ("bfloat16",) if (kind, layout) == ("fp32", "native") else WEIGHT_DTYPES[kind]   # bf16-valued
    dtypes = {"weight": weight_dtypes, "scales": ("float32",), "bias": (str(dtype).removeprefix("torch."),)}
    found = {}
    for part, tensor_name in parts.items():
        if tensor_name is None:
            if part == "weight" or (part == "scales" and kind in ("int8", *GROUPED)):
                raise _fail(path, f"the linear {name!r} has no {part}")
            found[part] = None
            continue
        if not isinstance(tensor_name, str) or tensor_name not in tensors:
            raise _fail(path, f"the linear {name!r} names a missing tensor {tensor_name!r}")
        shape_wanted, entry_found = wanted.get(part), tensors[tensor_name]
        if shape_wanted is not None and entry_found["shape"] != shape_wanted:
            raise _fail(path, f"tensor {tensor_name!r} has shape {entry_found['shape']}, not {shape_wanted}")
        if entry_found["dtype"] not in dtypes[part]:
            raise _fail(path, f"tensor {tensor_name!r} is {entry_found['dtype']}, not {' or '.join(dtypes[part])}")
        found[part] = _tensor(area, tensors[tensor_name], private)
    return PackedLinear.from_packed(found["weight"], found["scales"], found["bias"], kind, dtype, group, n, k, layout)


def stale_reason(path: Any, source: Any, dtype: Any, weights: Optional[str], group_size: int) -> Optional[str]:
    """Why the packed file at ``path`` cannot stand for ``source`` at this precision here (None: it can)."""
    if not Path(path).exists():
        return "missing"
    try:
        manifest, fd, _ = _read_manifest(path)
        os.close(fd)
        _check_kernel(path, manifest)
        _check_precision(path, manifest, dtype, weights, group_size if weights == "int4" else None)
    except PackedFileError as exc:
        return str(exc)
    recorded = manifest.get("source")
    if not isinstance(recorded, dict) or recorded.get("digest") != source_digest(source):
        return "another source checkpoint"
    return None


def _check_kernel(path: Any, manifest: dict) -> None:
    kernel = manifest.get("kernel")
    if not isinstance(kernel, dict):
        raise _fail(path, "the manifest's kernel record is malformed; rebuild it: from_pretrained(path, source=CHECKPOINT)")
    here = dict(level=(kernel_level(),), layout=expected_layouts(manifest.get("weights", "")),
                fingerprint=(layout_fingerprint(),))
    for key in ("level", "layout", "fingerprint"):
        if kernel.get(key) not in here[key]:
            raise _fail(path, f"packed for kernel {key} {kernel.get(key)!r}, this machine uses {here[key][0]!r}; "
                              "rebuild it: from_pretrained(path, source=CHECKPOINT)")


def _check_precision(path: Any, manifest: dict, dtype: Any, weights: Optional[str], group: Optional[int]) -> None:
    asked = {"dtype": None if dtype is None else DTYPES.get(dtype, str(dtype)),
             "weights": None if weights is None and dtype is None else (weights or DTYPES.get(dtype)),
             "group_size": group}
    for key, value in asked.items():
        if value is not None and manifest.get(key) != value:
            raise _fail(path, f"holds {key}={manifest.get(key)!r}, not the {value!r} asked for")


def _open(path: Any, dtype: Any, weights: Optional[str], group_size: Optional[int]) -> tuple[dict, mmap.mmap, Any]:
    """(manifest, the file mapped read-only, the activations' dtype) of a packed file usable here."""
    manifest, fd, _ = _read_manifest(path)
    try:
        _check_kernel(path, manifest)
        _check_precision(path, manifest, dtype, weights, group_size)
        area = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    if hasattr(area, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    dtype = {name: d for d, name in DTYPES.items()}.get(manifest.get("dtype"))
    if dtype is None:
        raise _fail(path, "the manifest lacks the model's dtype")
    return manifest, area, dtype


def _spec(path: Any, recorded: Any) -> DecoderSpec:
    """The decoder's shape as the manifest records it, every field checked."""
    spec = record_spec(recorded, MAX_LAYERS)
    if spec is None:
        raise _fail(path, "the manifest's decoder shape is malformed")
    return spec


def _parts(path: Any, manifest: dict, area: mmap.mmap, spec: DecoderSpec, dtype: Any, private: bool) -> Parts:
    """Every packed linear, norm and embedding of the file, each checked against ``spec`` first."""
    tensors, linears = manifest["tensors"], manifest.get("linears")
    if not isinstance(linears, dict):
        raise _fail(path, "the manifest has no linear table")
    expected = _expected_linears(spec)
    if set(linears) != set(expected):
        raise _fail(path, "its linears do not match the model's config")
    built = {name: _linear(path, name, linears[name], shape, area, tensors, dtype, private)
             for name, shape in expected.items()}
    embedding = manifest.get("embedding", "table")
    if embedding not in ("table", "lm_head") or (embedding == "lm_head" and not spec.tied_embeddings):
        raise _fail(path, f"its embedding {embedding!r} is neither a table nor a tied lm_head")
    plain = {"final_norm": [spec.hidden_size]}
    if embedding == "table":
        plain["embed"] = [spec.vocab_size, spec.hidden_size]
    for index in range(spec.num_layers):
        plain[f"layers.{index}.input_norm"] = plain[f"layers.{index}.post_attention_norm"] = [spec.hidden_size]
    for name, shape in plain.items():
        allowed = {dtype, *(SIXTEEN_BIT if name == "embed" and dtype == torch.float32 else ())}
        if name not in tensors or tensors[name]["shape"] != shape or TENSOR_DTYPES.get(tensors[name]["dtype"]) not in allowed:
            raise _fail(path, f"tensor {name!r} is missing or not {DTYPES[dtype]} of shape {shape}")
    get = {name: _tensor(area, tensors[name], private) for name in plain}
    layers = range(spec.num_layers)
    return Parts(embed=get.get("embed"), final_norm=get["final_norm"], lm_head=built["lm_head"],
                 input_norms=[get[f"layers.{i}.input_norm"] for i in layers],
                 post_attention_norms=[get[f"layers.{i}.post_attention_norm"] for i in layers],
                 linears=[{name: built[f"layers.{i}.{name}"] for name in LAYER_LINEARS} for i in layers])


def load_packed(path: Any, dtype: Any = None, weights: Optional[str] = None, group_size: Optional[int] = None,
                private: bool = False) -> Any:
    """The optimized model in a packed file, its tensors mapped read-only (``private``: copied to 2 MiB pages)."""
    import transformers

    manifest, area, dtype = _open(path, dtype, weights, group_size)
    config_dict = manifest.get("config")
    if not isinstance(config_dict, dict) or "model_type" not in config_dict:
        raise _fail(path, "the manifest lacks the model's config")
    generation = manifest.get("generation_config")
    try:    # the user's file: transformers' own checks raise whatever they raise (validation errors, TypeError...)
        model, spec = skeleton(transformers.AutoConfig.for_model(config_dict["model_type"]).__class__.from_dict(config_dict))
        generation = transformers.GenerationConfig.from_dict(generation) if generation else None
    except Exception as error:      # noqa: BLE001
        raise _fail(path, f"the manifest's model or generation config is malformed ({quoted(error, None)})") from None
    if manifest.get("decoder") is not None and _spec(path, manifest["decoder"]) != spec:
        raise _fail(path, "the decoder shape it records is not its config's")
    model.generation_config = generation if generation is not None else model.generation_config
    model = install(model, spec, dtype, _parts(path, manifest, area, spec, dtype, private))
    source = manifest.get("source")
    if isinstance(source, dict) and isinstance(source.get("path"), str) and source["path"]:
        object.__setattr__(model, SOURCE_ATTR, source["path"])
        object.__setattr__(model, DIGEST_ATTR, source.get("digest"))
    return model


def load_runtime(path: Any, dtype: Any = None, weights: Optional[str] = None, group_size: Optional[int] = None,
                 private: bool = False) -> tuple[DecoderRuntime, dict]:
    """(the runtime of a packed file, its manifest), built from the recorded decoder shape and RoPE: no
    transformers. A file without them (written before they were recorded) is one :class:`PackedFileError`."""
    manifest, area, dtype = _open(path, dtype, weights, group_size)
    if manifest.get("decoder") is None or manifest.get("rope") is None:
        raise _fail(path, "written before packed files recorded the decoder's shape; load it with "
                          "xlaunch.llm.from_pretrained(path), or rebuild it: from_pretrained(path, source=CHECKPOINT)")
    spec = _spec(path, manifest["decoder"])
    rope, tensors = manifest["rope"], manifest["tensors"]
    scaling = rope.get("attention_scaling") if isinstance(rope, dict) else None
    entry = tensors.get("rope.inv_freq")
    if (type(scaling) not in (int, float) or not math.isfinite(scaling) or not isinstance(entry, dict)
            or entry["dtype"] != "float32" or entry["shape"] != [spec.head_dim // 2]):
        raise _fail(path, "its RoPE record is malformed")
    inv_freq = _tensor(area, entry, private=True)
    if not bool(torch.isfinite(inv_freq).all()):
        raise _fail(path, "its RoPE record is malformed (frequencies that are not finite)")
    table = RopeTable(inv_freq, scaling, spec.head_dim, dtype)
    return runtime_of(spec, dtype, _parts(path, manifest, area, spec, dtype, private), table), manifest
