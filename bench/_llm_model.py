"""bench/llm.py's model: a preset shape (``--shape``, xlaunch/llm/shapes.py: random weights) or a user's
Hugging Face checkpoint (``--model PATH``), where its files and GGUF conversions live, and the memory
and disk a run needs (checked before anything starts). No torch here.

A preset's checkpoint is cached under ``<cache>/llm-shapes/<name>-seed<seed>-<key>`` (shared with
examples/llm.py); the bench adds its sentencepiece tokenizer there (llama.cpp's converter needs one;
the timings never tokenize). GGUF files go to ``<cache>/llamacpp/gguf-<key>/``, never into a user's
checkpoint directory.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import _llamacpp

from xlaunch.llm import footprint, shapes
from xlaunch.llm.footprint import MiB

SEED = 0
SPM_PIECES = 32000                  # the converter pads a larger vocabulary with [PAD] tokens
COMPILE_BYTES = 600 * MiB           # inductor's compile of the decode step, on top of the model
CONVERT_BYTES = 600 * MiB           # convert_hf_to_gguf.py's Python, torch and gguf-py
LLAMA_PROCESS_BYTES = 200 * MiB     # llama-bench besides its GGUF, KV cache and logits


@dataclass
class BenchModel:
    """The model a run times: its name, config, checkpoint folder and GGUF folder."""

    name: str
    config: dict[str, Any]
    folder: Path                  # the checkpoint (written by --make-model when a preset's is missing)
    gguf_dir: Path
    preset: bool

    @property
    def shape(self) -> shapes.Shape:
        return shapes.Shape(self.config)

    @property
    def packed_dir(self) -> Path:
        """Where ``--instances`` keeps the packed files the instances map (``<cache>/llm-packed/<model key>``)."""
        return self.gguf_dir.parent.parent / "llm-packed" / self.gguf_dir.name.removeprefix("gguf-")

    def ready(self) -> bool:
        return (self.folder / "model.safetensors").is_file() and (not self.preset or (self.folder / "tokenizer.model").is_file())

    def checkpoint_dtype(self) -> str:
        """The safetensors dtype of the checkpoint's first weight ("F32", "BF16", ...), from its header."""
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            return "BF16" if self.config.get("torch_dtype", self.config.get("dtype")) == "bfloat16" else "F32"
        with open(files[0], "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        return next(entry["dtype"] for name, entry in header.items() if name != "__metadata__")

    def q4_source(self) -> str:
        """The GGUF Q4_0 is quantized from: BF16 when the checkpoint is bf16 (the same values), else F32."""
        return "bf16" if self.checkpoint_dtype() == "BF16" else "f32"


def resolve(shape: Optional[str], model: Optional[str]) -> BenchModel:
    """``--model`` (a checkpoint directory) or ``--shape`` (a preset); :class:`shapes.ShapeError` on a bad one."""
    if model:
        folder = Path(model).expanduser().resolve()
        config = shapes.read_config(folder)
        if not list(folder.glob("*.safetensors")):
            raise shapes.ShapeError(f"--model: {folder} has no *.safetensors file")
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + str(folder).encode())
        for path in sorted(folder.glob("*.safetensors")):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return BenchModel(folder.name, config, folder, _llamacpp.cache_root() / f"gguf-{digest.hexdigest()[:12]}", False)
    name = shape or shapes.DEFAULT
    config = shapes.preset(name)
    folder = shapes.cached_checkpoint(name, SEED)
    return BenchModel(name, config, folder, _llamacpp.cache_root() / f"gguf-{folder.name}", True)


def written(model: BenchModel, script: str) -> Path:
    """The checkpoint folder; a preset's is written first when missing, by ``script --make-model`` (bench/llm.py's
    option: torch runs in that subprocess)."""
    if not model.ready():
        print(f"writing the {model.name} checkpoint and tokenizer to {model.folder}", flush=True)
        subprocess.run([sys.executable, script, "--make-model", model.name], check=True)
    return model.folder


def make(name: str, seed: int = SEED) -> None:
    """Preset ``name``'s checkpoint (cached) and the bench's tokenizer next to it (runs in a subprocess: torch)."""
    folder = shapes.ensure_checkpoint(name, seed)
    target = folder / "tokenizer.model"
    if not target.exists():
        partial = folder / "tokenizer.model.partial"
        shutil.copyfile(tokenizer(), partial)
        partial.rename(target)


def tokenizer() -> Path:
    """A sentencepiece BPE model of 32000 pieces trained on generated words (once, about 20 s)."""
    import random

    folder = _llamacpp.cache_root() / f"tokenizer-spm{SPM_PIECES}-seed{SEED}"
    model = folder / "tokenizer.model"
    if model.exists():
        return model
    try:
        import sentencepiece
    except ImportError:
        raise SystemExit("bench/llm.py needs sentencepiece for the GGUF tokenizer: pip install -e '.[bench-llm]'") from None
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(60000)]
    lines = (" ".join(rng.choice(words) for _ in range(12)) for _ in range(40000))
    print("  training the sentencepiece tokenizer (about 20 s)", flush=True)
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=lines, model_prefix=str(folder / "partial"),
                                             vocab_size=SPM_PIECES, model_type="bpe", hard_vocab_limit=False,
                                             minloglevel=2)
    (folder / "partial.vocab").unlink(missing_ok=True)
    (folder / "partial.model").rename(model)
    return model


# -- what a run needs ------------------------------------------------------------------------------
def gguf_bytes(shape: shapes.Shape, kind: str) -> int:
    """A GGUF file of ``kind``: F32, BF16, Q8_0 (34 bytes a block of 32), Q4_0 (18 bytes a block of 32; the output
    matrix, or the tied embedding, at Q6_K: 210 bytes a block of 256, as llama-quantize keeps it)."""
    params = shape.parameters()
    head = shape.vocab * shape.hidden
    per_param = {"f32": 4.0, "bf16": 2.0, "q8_0": 34 / 32}
    if kind in per_param:
        return int(params * per_param[kind])
    return int((params - head) * 18 / 32 + head * 210 / 256)


# xlaunch's routes: (activations, weights); None activations: the CPU's default (footprint.default_activations)
XLAUNCH_ROUTES = {"xlaunch-fp32": ("fp32", None), "xlaunch-bf16": ("bf16", None), "xlaunch-int8": (None, "int8"),
                  "xlaunch-int4": (None, "int4")}


def xlaunch_precision(route: str) -> tuple[str, Optional[str]]:
    """(activations "fp32" or "bf16", weights None / "int8" / "int4") of an xlaunch route."""
    activations, weights = XLAUNCH_ROUTES[route]
    return activations or footprint.default_activations(), weights


def route_bytes(route: str, shape: shapes.Shape, checkpoint: int, prompt: int, tokens: int,
                batch: int = 1) -> tuple[int, int]:
    """(steady, peak) resident bytes of one torch route's process: the model, its KV cache, a prefill's
    temporaries (and xlaunch's widening buffer where its kernel choice measures); the peak adds what
    loading holds (transformers maps the checkpoint; the streamed loader holds a chunk and the embedding
    before its cast)."""
    activations = footprint.activation_bytes(shape, prompt, batch)
    base = footprint.TORCH_PROCESS_BYTES + activations
    if route.startswith("xlaunch-"):
        dtype, weights = xlaunch_precision(route)
        steady = (base + footprint.packed_bytes(shape, dtype, weights) + footprint.kv_cache_bytes(shape, tokens, batch, dtype)
                  + footprint.widening_buffer_bytes(shape, dtype))
        return steady, steady + footprint.streamed_load_bytes(shape, dtype)
    dtype = "fp32" if route == "hf-fp32" else "bf16"
    steady = base + footprint.dense_bytes(shape, dtype) + footprint.kv_cache_bytes(shape, tokens, batch, dtype)
    if route in ("hf-bf16-compiled", "torchao-int8"):
        steady += COMPILE_BYTES
    return steady, steady + checkpoint


def llama_bytes(shape: shapes.Shape, kind: str, prompt: int, tokens: int, batch: int = 1) -> int:
    """llama-bench (or llama-batched-bench): its mapped GGUF, an F16 KV cache of the context, the logits of a
    batch of prompt tokens."""
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch * 2
    return gguf_bytes(shape, kind) + kv + 4 * shape.vocab * min(512, prompt) + LLAMA_PROCESS_BYTES


def _preparing(model: BenchModel, gguf_kinds: Sequence[str]) -> tuple[list[tuple[str, int]], int, int]:
    """The phases before any timing (writing the checkpoint, converting to GGUF), the disk their files still
    need, and the checkpoint's size."""
    shape = model.shape
    checkpoint = shapes.checkpoint_bytes(model.config) if model.preset else \
        sum(path.stat().st_size for path in model.folder.glob("*.safetensors"))
    phases: list[tuple[str, int]] = []
    disk = 0
    if not model.ready():
        phases.append(("writing the checkpoint", footprint.TORCH_PROCESS_BYTES + 3 * shapes.CHUNK_BYTES))
        disk += checkpoint
    wanted = list(gguf_kinds)
    if "q4_0" in wanted and model.q4_source() not in wanted:
        wanted.append(model.q4_source())
    missing = [kind for kind in wanted if not (model.gguf_dir / f"{kind}.gguf").exists()]
    if missing:
        phases.append(("converting to GGUF", CONVERT_BYTES + 3 * 4 * shape.vocab * shape.hidden))
        disk += sum(gguf_bytes(shape, kind) for kind in missing)
    return phases, disk, checkpoint


def need(model: BenchModel, torch_routes: Sequence[str], gguf_kinds: Sequence[str], prompt: int,
         new_tokens: int, batch: int = 1) -> footprint.Need:
    """The largest phase of a run (writing the checkpoint, converting to GGUF, the routes of one thread count
    side by side with one llama-bench) and the disk its files still need."""
    shape = model.shape
    phases, disk, checkpoint = _preparing(model, gguf_kinds)
    tokens = prompt + new_tokens + 1
    sizes = [route_bytes(route, shape, checkpoint, prompt, tokens, batch) for route in torch_routes]
    llama = max((llama_bytes(shape, kind, prompt, tokens, batch) for kind in gguf_kinds), default=0)
    if sizes or llama:
        together = sum(steady for steady, _ in sizes) + max((p - s for s, p in sizes), default=0) + llama
        what = f"{len(sizes)} torch route(s) side by side" + (" and llama-bench" if llama else "")
        phases.append((what, together))
    memory, what = footprint.peak(phases) if phases else (0, "nothing")
    return footprint.Need(memory, what, disk, str(_llamacpp.cache_root().parent))


def need_instances(model: BenchModel, xlaunch_routes: Sequence[str], gguf_kinds: Sequence[str], instances: int,
                   prompt: int, new_tokens: int) -> footprint.Need:
    """``--instances k``: one route at a time, k copies sharing its packed file (or GGUF) in the page cache;
    before that, each packed file written once (a route's load peak) next to its size on disk."""
    shape = model.shape
    phases, disk, checkpoint = _preparing(model, gguf_kinds)
    tokens = prompt + new_tokens + 1
    for route in xlaunch_routes:
        steady, peak = route_bytes(route, shape, checkpoint, prompt, tokens)
        packed = footprint.packed_bytes(shape, *xlaunch_precision(route))
        phases.append((f"packing {route}", peak))
        phases.append((f"{instances} instance(s) of {route}", instances * (steady - packed) + packed))
        if not (model.packed_dir / f"{route}.xlp").exists():
            disk += packed
    for kind in gguf_kinds:
        gguf = gguf_bytes(shape, kind)
        phases.append((f"{instances} llama-bench of {kind.upper()}",
                       instances * (llama_bytes(shape, kind, prompt, tokens) - gguf) + gguf))
    memory, what = footprint.peak(phases) if phases else (0, "nothing")
    return footprint.Need(memory, what, disk, str(_llamacpp.cache_root().parent))
