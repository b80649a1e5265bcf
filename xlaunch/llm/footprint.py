"""How much memory and disk a decoder shape needs, from its config alone (no torch), and what this
machine has: examples/llm.py and bench/llm.py check a shape before they start anything.

The sizes follow what runs: :func:`packed_bytes` counts :class:`~xlaunch.llm.linear.PackedLinear`'s
buffers (native layout: output channels padded to 64; INT8 one fp32 scale per channel; INT4 one per
group and channel; lm_head INT6 under INT4, :func:`lm_head_kind`; buffers from 2 MiB up rounded to 2 MiB pages), the
norms in the activations' dtype, the embedding too unless the checkpoint's is 16-bit (kept so) or it is
tied (the packed lm_head's rows: no table); :func:`kv_cache_bytes` the preallocated cache;
:func:`activation_bytes` a prefill's largest temporaries (the logits of every prompt token in fp32
when the model is called on the whole prompt). :data:`TORCH_PROCESS_BYTES` is a Python process with
torch and transformers imported. Available memory is ``MemAvailable`` of ``<root>/proc/meminfo``
(``<root>``: ``$XLAUNCH_FSROOT``, default ``/``, so a test can fake it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from xlaunch.llm.shapes import Shape

MiB, GiB = 1 << 20, 1 << 30
HUGE_PAGE = 2 * MiB
BLOCK = 64                                # output channels per native block (csrc/linear.h: kBlock)
TORCH_PROCESS_BYTES = 450 * MiB           # python + torch + transformers imported, before any model
BYTES = {"fp32": 4, "bf16": 2}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the CPU flags of native bf16 dot products
LOAD_CHUNK_BYTES = 1 << 20                # xlaunch.llm.loader.CHUNK_BYTES
WIDEN_SLICE_BYTES = 32 * MiB              # the most of a weight the dense route widens at once (per thread)
HEAD_GROUP = 64                           # the INT6 lm_head's group of inputs under INT4 weights
GROUPED = ("int4", "int6")                # the weight kinds quantized per group of inputs


def lm_head_kind(weights: str, in_features: int, kernels: bool = True) -> str:
    """The packed kind of lm_head under the layers' ``weights`` kind: INT4 layers get a 6-bit lm_head in groups
    of :data:`HEAD_GROUP` (llama.cpp's Q4_0 files keep theirs at Q6_K, 6.56 bits a weight; this one is 6.5),
    where the compiled kernels run it (``kernels``) and ``in_features`` is a multiple of the group; else INT8.
    lm_head is read whole every token: on Llama-3.2-1B's shape (128k x 2048) INT8 is 250 MiB a token of the
    INT4 model's 745, INT6 204."""
    if weights != "int4":
        return weights
    return "int6" if kernels and in_features % HEAD_GROUP == 0 else "int8"


def lm_head_packing(weights: str, in_features: int, group_size: int, kernels: bool = True) -> tuple[str, int]:
    """(kind, group size) of lm_head under the layers' ``weights`` kind (:func:`lm_head_kind`): INT6 takes
    :data:`HEAD_GROUP`, any other kind the layers' ``group_size``."""
    kind = lm_head_kind(weights, in_features, kernels)
    return kind, HEAD_GROUP if kind == "int6" else group_size


def _buffer(nbytes: int) -> int:
    """A buffer's resident bytes: from 2 MiB up it sits on its own 2 MiB pages."""
    return nbytes if nbytes < HUGE_PAGE else -(-nbytes // HUGE_PAGE) * HUGE_PAGE


def packed_linear_bytes(n: int, k: int, kind: str, group_size: int = 128, kernels: bool = True) -> int:
    """One packed linear of ``n`` outputs over ``k`` inputs (weights and scales; bias apart); ``kernels``
    False: INT4 in ATen's layout (no padding, a scale and a zero point in fp32 per group and channel)."""
    if kind == "int4" and not kernels:
        return _buffer(n * k // 2) + 8 * n * (k // group_size)
    padded = -(-n // BLOCK) * BLOCK
    if kind == "fp32":
        return _buffer(4 * n * k)
    if kind == "bf16":
        return _buffer(2 * padded * k)
    if kind == "int8":
        return _buffer(padded * -(-k // 4) * 4) + 4 * padded
    if kind == "int4":
        return _buffer(padded * k // 2) + 4 * padded * (k // group_size)
    if kind == "int6":
        return _buffer(padded * k // 4 * 3) + 4 * padded * (k // group_size)
    raise ValueError(f"unknown weight kind {kind!r}")


def packed_shapes(kind: str, layout: str, n: int, k: int, group_size: int) -> dict[str, Optional[list[int]]]:
    """The shapes :class:`~xlaunch.llm.linear.PackedLinear` gives the "weight" and "scales" of one linear of
    ``n`` outputs over ``k`` inputs: ``layout`` "native" (csrc/linear.h: blocks of 64 channels) or "aten"
    (ATen's kernels'). A part the kind does not have is absent; None: not known ahead (ATen's opaque int4)."""
    blocks, groups = -(-n // BLOCK), k // max(group_size, 1)
    if layout == "native":
        return {"fp32": {"weight": [blocks, -(-k // 2), 2 * BLOCK]},     # bf16-valued fp32 weights, stored as bf16
                "bf16": {"weight": [blocks, -(-k // 2), 2 * BLOCK]},
                "int8": {"weight": [blocks, -(-k // 4), 4 * BLOCK], "scales": [blocks, BLOCK]},
                "int4": {"weight": [blocks, k // 4, 2 * BLOCK], "scales": [blocks, groups, BLOCK]},
                "int6": {"weight": [blocks, k // 4, 3 * BLOCK], "scales": [blocks, groups, BLOCK]}}.get(kind, {})
    return {"fp32": {"weight": [n, k]}, "bf16": {"weight": [n, k]}, "int8": {"weight": [n, k], "scales": [n]},
            "int4": {"weight": None, "scales": [groups, -(-n // 16) * 16, 2]},
            "int6": {"weight": [n, k], "scales": [n, groups]}}[kind]


def packed_linears(shape: Shape) -> list[tuple[int, int]]:
    """A layer's packed linears as (outputs, inputs): q/k/v together, o, gate/up together, down."""
    linears = shape.linears()
    qkv = sum(linears[f"self_attn.{p}_proj"][0] for p in "qkv")
    gate_up = linears["mlp.gate_proj"][0] + linears["mlp.up_proj"][0]
    return [(qkv, shape.hidden), linears["self_attn.o_proj"], (gate_up, shape.hidden), linears["mlp.down_proj"]]


def packed_bytes(shape: Shape, dtype: str, weights: Optional[str] = None, group_size: int = 128,
                 kernels: bool = True) -> int:
    """The weights of ``xlaunch.llm.optimize`` / ``from_pretrained`` of ``shape``: activations ``dtype``
    ("fp32" or "bf16"), ``weights`` None (the dtype), "int8" or "int4". fp32 weights count 4 bytes: a bound, since
    a bf16 checkpoint's are kept as bf16 (:func:`xlaunch.llm.linear.bf16_valued`). ``kernels``: the compiled
    kernels run (what setup builds; ``xlaunch.llm.native.available()`` says, at the price of importing torch);
    without them INT4 takes ATen's layout and an INT8 lm_head, about 10% more on the tiny test models."""
    kind = weights or dtype
    size = BYTES[dtype]
    groups = packed_linears(shape)
    per_layer = sum(packed_linear_bytes(n, k_, kind, group_size, kernels) for n, k_ in groups)
    biases = groups[0][0] * shape.qkv_bias + shape.hidden * shape.o_bias
    per_layer += size * (biases + 2 * shape.hidden)                       # biases and the two norms
    head = packed_linear_bytes(shape.vocab, shape.hidden, *lm_head_packing(kind, shape.hidden, group_size, kernels),
                               kernels=kernels)
    embed = 0 if shape.tied else _buffer(embedding_bytes(shape, dtype) * shape.vocab * shape.hidden)
    return shape.layers * per_layer + head + embed + size * shape.hidden


def embedding_bytes(shape: Shape, dtype: str) -> int:
    """Bytes per value of the embedding as the runtime keeps it: a 16-bit checkpoint's stays 16-bit under
    fp32 activations (``xlaunch.llm.decoder.embedding_table``; an fp32 checkpoint is counted at 4)."""
    from xlaunch.llm.shapes import DTYPE_BYTES

    return min(BYTES[dtype], DTYPE_BYTES.get(shape.dtype, 4))


def dense_bytes(shape: Shape, dtype: str) -> int:
    """A Hugging Face model of ``shape`` in ``dtype`` (every parameter, a tied lm_head once)."""
    return shape.parameters() * BYTES[dtype]


def kv_cache_bytes(shape: Shape, tokens: int, batch: int = 1, dtype: str = "bf16") -> int:
    """Keys and values of every layer for ``tokens`` positions of ``batch`` rows."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch * BYTES[dtype]


def activation_bytes(shape: Shape, tokens: int, batch: int = 1) -> int:
    """A forward over ``tokens`` prompt tokens: the fp32 logits of every position and one layer's temporaries."""
    width = 2 * shape.intermediate + (shape.heads + 2 * shape.kv_heads) * shape.head_dim + 4 * shape.hidden
    return 4 * batch * tokens * (shape.vocab + width)


def native_bf16() -> bool:
    """Whether bf16 dot products are native here: the CPU has AVX512_BF16 or AMX_BF16 (the machine model), and
    ``$XLAUNCH_CPU_ISA`` does not cap the kernels below the ``avx512_bf16`` level (capped to ``avx2`` on a Zen 4,
    they widen bf16 to fp32 as on an AVX2 CPU, and the defaults follow: fp32 activations)."""
    from xlaunch._isa_levels import CAP_ENV, LEVELS, multiplies_bf16
    from xlaunch.machine import current_machine

    cap = os.environ.get(CAP_ENV, "").strip().lower()
    if cap in LEVELS and not multiplies_bf16(cap):
        return False
    return any(flag in current_machine().isa.flags for flag in BF16_FLAGS)


def default_activations() -> str:
    """``xlaunch.llm.default_dtype()`` without torch: "bf16" where the CPU has native bf16 dot products, else "fp32"."""
    return "bf16" if native_bf16() else "fp32"


def widened_slice_channels(n: int, k: int, itemsize: int) -> int:
    """How many of an ``[n, k]`` weight's output channels the dense route widens at once: all of them when they
    fit in :data:`WIDEN_SLICE_BYTES`, else the most whole blocks of 64 that do (at least one block)."""
    if n * k * itemsize <= WIDEN_SLICE_BYTES:
        return n
    return max(BLOCK, WIDEN_SLICE_BYTES // (k * itemsize) // BLOCK * BLOCK)


def widening_buffer_bytes(shape: Shape, dtype: str) -> int:
    """The buffer :mod:`xlaunch.llm.kernel_choice`'s dense route keeps per thread: the largest slice of a
    linear (q/k/v, o, gate/up, down, lm_head) it widens to bf16 at once, where the choice measures (bf16
    activations on a CPU with native bf16); 0 elsewhere."""
    if dtype != "bf16" or not native_bf16():
        return 0
    linears = [*packed_linears(shape), (shape.vocab, shape.hidden)]
    return BYTES["bf16"] * max(widened_slice_channels(n, k, BYTES["bf16"]) * k for n, k in linears)


def streamed_load_bytes(shape: Shape, dtype: str) -> int:
    """What ``xlaunch.llm.from_pretrained`` holds beyond the packed model while it loads: the embedding as
    read from the checkpoint before its cast (none when it is kept as stored; under fp32 activations an fp32
    checkpoint's may turn out to hold only bf16 values, and its 16-bit copy is made beside it) and a chunk
    of rows."""
    from xlaunch.llm.shapes import DTYPE_BYTES

    stored, values = DTYPE_BYTES.get(shape.dtype, 4), shape.vocab * shape.hidden
    if shape.tied:               # a tied embedding is the packed lm_head's rows: no table is read
        held = 0
    elif stored == embedding_bytes(shape, dtype):
        held = 2 * values if stored == BYTES[dtype] == 4 else 0
    else:
        held = stored * values
    return held + 4 * LOAD_CHUNK_BYTES


def disk_free(path: Any) -> Optional[int]:
    """Bytes free for this user on the filesystem that holds ``path`` (or its nearest existing parent)."""
    place = Path(path).absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        stat = os.statvfs(place)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


@dataclass
class Need:
    """A run's peak memory (the largest of its phases) and the disk it writes, with what each is."""

    memory: int
    memory_what: str
    disk: int = 0
    disk_where: Optional[str] = None


def peak(phases: Sequence[tuple[str, int]]) -> tuple[int, str]:
    """The largest of ``(what, bytes)`` phases."""
    what, nbytes = max(phases, key=lambda phase: phase[1])
    return nbytes, what


def refusal(program: str, shape_name: str, need: Need, root: Optional[str] = None, hint: str = "") -> Optional[str]:
    """One line saying why ``need`` does not fit this machine (memory, then disk), or None when it fits."""
    from xlaunch.machine import memory_available

    available = memory_available(root)
    if available is not None and need.memory > available:
        return (f"{program}: shape {shape_name} needs about {gib(need.memory)} of memory ({need.memory_what}), "
                f"this machine has {gib(available)} available (MemAvailable); nothing was started{hint}")
    if need.disk and need.disk_where:
        free = disk_free(need.disk_where)
        if free is not None and need.disk > free:
            return (f"{program}: shape {shape_name} needs {gib(need.disk)} of disk under {need.disk_where}, "
                    f"{gib(free)} is free; nothing was started")
    return None
