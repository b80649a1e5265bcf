"""The files of a Hugging Face safetensors checkpoint directory, read within bounds with ``pread``.

:class:`Checkpoint` finds the files transformers reads (``model.safetensors``, else the shards
``model.safetensors.index.json`` names, else every ``*.safetensors``) and reads tensors by name, a range
of rows at a time; :class:`SafetensorsFile` is one file, its header checked (every entry's byte range in
the file and holding its shape). Regular files only: a FIFO or a device is one ValueError line, never a
blocked read. Used by :mod:`xlaunch.llm.loader`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from xlaunch import userfiles
from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")    # read by transformers, not here


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# every dtype a safetensors header may name, by its element size: a tensor's byte range must match its shape
SAFETENSORS_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
                     "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100 << 20
MAX_CONFIG = 64 << 20            # config.json, and a header's bytes in the digest (packed_file.MAX_HEADER)
SAMPLES, SAMPLE_BYTES = 16, 64 << 10   # the digest's sampled blocks of each file
MAX_INDEX = 16 << 20             # model.safetensors.index.json: about 100 KB for a 70B model


class SafetensorsFile:
    """One safetensors file read with ``pread``: a mapping (what ``safe_open`` does) would count every
    page read in this process's RSS until it is closed; plain reads leave them in the page cache."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:   # a regular file only: a FIFO or a device is refused without blocking (xlaunch.userfiles)
            self.fd = userfiles.open_user_file(str(path), limit=userfiles.UNCAPPED)   # read: the header's ranges
        except userfiles.UserFileError as error:
            raise ValueError(f"xlaunch.llm.from_pretrained: {error}") from None
        try:
            self.size = os.fstat(self.fd).st_size
            self.entries = self._header()
        except BaseException:
            os.close(self.fd)
            raise

    def _header(self) -> dict:
        """The header's entries, each checked: a byte range inside the data that its shape and dtype fill."""
        prefix = os.pread(self.fd, 8, 0)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_SAFETENSORS_HEADER, self.size - 8):
            raise ValueError(f"xlaunch.llm.from_pretrained: {self.path} is not a safetensors file")
        try:
            header = json.loads(os.pread(self.fd, length, 8))
        except (ValueError, RecursionError):
            header = None
        if not isinstance(header, dict):
            raise ValueError(f"xlaunch.llm.from_pretrained: {self.path} is not a safetensors file (its header)")
        header.pop("__metadata__", None)
        self.start = 8 + length
        for name, entry in header.items():
            self._check_entry(name, entry)
        # two entries over the same bytes (safetensors refuses such a file): one tensor read the other's values
        spans = sorted((entry["data_offsets"], name) for name, entry in header.items()
                       if entry["data_offsets"][0] < entry["data_offsets"][1])
        for ((_, end), first), ((start, _), second) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(f"xlaunch.llm.from_pretrained: {first} and {second} in {self.path} share bytes "
                                 "(their data_offsets overlap: a malformed header)")
        return header

    def _check_entry(self, name: str, entry: Any) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"xlaunch.llm.from_pretrained: {name} in {self.path} {why}")

        if not isinstance(entry, dict):
            raise bad("is not a tensor entry")
        shape, offsets, dtype = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in shape):
            raise bad(f"has no valid shape ({shape!r})")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= self.size - self.start):
            raise bad(f"has data offsets {offsets!r} outside the file's data (truncated?)")
        if not isinstance(dtype, str):
            raise bad(f"has no dtype ({dtype!r})")
        size = SAFETENSORS_SIZES.get(dtype)     # an unknown dtype is refused if the model reads it (rows)
        numel = math.prod(shape)
        if size is not None and numel * size != offsets[1] - offsets[0]:
            raise bad(f"holds {offsets[1] - offsets[0]} bytes, but its shape {shape} of {dtype} takes {numel * size}")

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def rows(self, name: str, start: int, stop: int) -> "torch.Tensor":
        """Rows [start, stop) of a tensor (the whole of a 1-D one: start 0, stop its length)."""
        entry = self.entries[name]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"xlaunch.llm.from_pretrained: {name} in {self.path} is {entry['dtype']}, "
                             f"not one of {', '.join(SAFETENSORS_DTYPES)}")
        shape = entry["shape"]
        row = int(torch.Size(shape[1:]).numel()) * torch.empty(0, dtype=dtype).element_size()
        begin, _ = entry["data_offsets"]        # checked against the shape and the file (_check_entry)
        offset, nbytes = self.start + begin + start * row, (stop - start) * row
        if not 0 <= start <= stop <= (shape[0] if shape else 1):
            raise ValueError(f"xlaunch.llm.from_pretrained: rows {start}:{stop} are outside {name} in {self.path}")
        data = bytearray(nbytes)
        view, done = memoryview(data), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"xlaunch.llm.from_pretrained: {self.path} ends inside {name} (truncated?)")
            done += got
        if not nbytes:
            return torch.empty((stop - start, *shape[1:]), dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape((stop - start, *shape[1:]) if shape else ())


def weight_files(path: Path) -> list[str]:
    """The files transformers reads: ``model.safetensors``, else the index's shards, else (no index: shards
    whose index is lost) every ``*.safetensors``. Other files beside ``model.safetensors`` (an EMA copy, an
    adapter) are not read: they were, and a name in two files took the last file's values."""
    if os.path.lexists(path / WEIGHTS):
        return [WEIGHTS]
    files = _index_files(path) if os.path.lexists(path / INDEX) else sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        other = [name for name in TORCH_WEIGHTS if os.path.lexists(path / name)]
        hint = f" (only {other[0]}: save it as safetensors, save_pretrained does by default)" if other else ""
        raise ValueError(f"xlaunch.llm.from_pretrained: {path} has no *.safetensors file{hint}")
    return files


def _index_files(path: Path) -> list[str]:
    """The shard files ``model.safetensors.index.json`` names: plain names in this folder, nowhere else."""
    where = path / INDEX
    try:
        index = json.loads(userfiles.read_user_text(str(where), limit=MAX_INDEX))
    except userfiles.UserFileError as error:
        raise ValueError(f"xlaunch.llm.from_pretrained: {error}") from None
    except (ValueError, RecursionError):
        index = None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"xlaunch.llm.from_pretrained: {where} has no weight_map of tensor names to files")
    files = sorted(set(weight_map.values()))
    if not files:       # said "has no *.safetensors file" beside the shards
        raise ValueError(f"xlaunch.llm.from_pretrained: {where} names no files (its weight_map is empty)")
    outside = [name for name in files if name in ("", ".", "..") or Path(name).name != name]
    if outside:
        raise ValueError(f"xlaunch.llm.from_pretrained: {where} names a file outside {path}: {outside[0]!r}")
    return files


def source_digest(path: Any) -> str:
    """A digest of a checkpoint directory: config.json, generation_config.json (or its absence: the packed file
    records it), the size and header of each file :func:`weight_files` names (none when it names none: the load
    says why), sampled bytes. Regular files only (a FIFO or a device is one
    :class:`~xlaunch.userfiles.UserFileError`, never a blocked read)."""
    path = Path(path)
    digest = hashlib.sha256(userfiles.read_user_file(str(path / "config.json"), limit=MAX_CONFIG))
    generation = path / "generation_config.json"
    digest.update(b"generation_config.json:" + (userfiles.read_user_file(str(generation), limit=MAX_CONFIG)
                                                if os.path.lexists(generation) else b"none"))
    try:
        files = weight_files(path)
    except userfiles.UserFileError:
        raise
    except ValueError:
        files = []
    for name in files:
        fd = userfiles.open_user_file(str(path / name), limit=userfiles.UNCAPPED)   # read: its header and samples
        try:
            size = os.fstat(fd).st_size
            digest.update(f"{name}:{size}".encode())
            head = os.pread(fd, 8, 0)
            digest.update(head + (os.pread(fd, min(struct.unpack("<Q", head)[0], MAX_CONFIG), 8)
                                  if len(head) == 8 else b""))
            for i in range(SAMPLES):
                digest.update(os.pread(fd, SAMPLE_BYTES, size * i // SAMPLES))
        finally:
            os.close(fd)
    return digest.hexdigest()


class Checkpoint:
    """The tensors of a Hugging Face safetensors checkpoint directory, read lazily by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not os.path.lexists(path / "config.json"):    # a FIFO or a dangling link there: the loader's one line
            cache = path / "snapshots"      # a Hugging Face cache folder, models--org--name: snapshots/<revision>/
            snapshots = sorted(entry.name for entry in cache.glob("*")) if cache.is_dir() else []
            hint = f" (a Hugging Face cache folder: give {cache / snapshots[0]})" if len(snapshots) == 1 else (
                f" (a Hugging Face cache folder: give one of {cache}/*)" if snapshots else "")
            raise ValueError(f"xlaunch.llm.from_pretrained: {path} has no config.json{hint}")
        files = weight_files(path)
        self.files: dict[str, SafetensorsFile] = {}
        self.weight_map: dict[str, str] = {}
        try:
            for name in files:
                self.files[name] = SafetensorsFile(path / name)
                for key in self.files[name].entries:
                    if key in self.weight_map:      # which one counts? refused rather than one chosen silently
                        raise ValueError(f"xlaunch.llm.from_pretrained: {key} is in both {self.weight_map[key]} and "
                                         f"{name} in {path}; keep one of them")
                    self.weight_map[key] = name
        except BaseException:
            self.close()
            raise

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str) -> SafetensorsFile:
        if name not in self.weight_map:
            raise ValueError(f"xlaunch.llm.from_pretrained: {self.path} lacks the tensor {name}")
        return self.files[self.weight_map[name]]

    def tensor(self, name: str) -> "torch.Tensor":
        handle = self._handle(name)
        shape = handle.shape(name)
        return handle.rows(name, 0, shape[0] if shape else 1)

    def shape(self, name: str) -> list[int]:
        return self._handle(name).shape(name)

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name (``BF16``, ``F32``...)."""
        return str(self._handle(name).entries[name]["dtype"])

    def rows(self, name: str, start: int, stop: int) -> "torch.Tensor":
        return self._handle(name).rows(name, start, stop)

    def close(self) -> None:
        for handle in self.files.values():
            os.close(handle.fd)
