"""bench/llm.py's routes: each torch or llama.cpp route, the pairs ``--instances`` runs, and the
environment that caps a torch process at an ``--isa`` level. No torch here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import _llamacpp

@dataclass(frozen=True)
class Route:
    name: str
    engine: str          # "torch" or "llamacpp"
    precision: str       # the llama.cpp type it is compared with: f32, bf16, q8_0, q4_0
    what: str
    quick: bool = True   # part of --quick's default set


ROUTES = {route.name: route for route in (
    Route("hf-fp32", "torch", "f32", "HF eager fp32, generate (dynamic cache)"),
    Route("hf-bf16", "torch", "bf16", "HF eager bf16, generate (dynamic cache)"),
    Route("hf-bf16-compiled", "torch", "bf16", "HF bf16, static cache + torch.compile", quick=False),
    Route("torchao-int8", "torch", "q8_0", "HF bf16 + torchao int8 weight-only, static cache + torch.compile"),
    Route("xlaunch-fp32", "torch", "f32", "xlaunch.llm.optimize(model, dtype=float32): fp32 weights, the default "
          "activations without native bf16", quick=False),
    Route("xlaunch-bf16", "torch", "bf16", "xlaunch.llm.optimize(model, dtype=bfloat16)"),
    Route("xlaunch-int8", "torch", "q8_0", 'xlaunch.llm.optimize(model, weights="int8"): the CPU\'s default dtype'),
    Route("xlaunch-int4", "torch", "q4_0", 'xlaunch.llm.optimize(model, weights="int4"): the CPU\'s default dtype'),
    *(Route(f"llamacpp-{kind}", "llamacpp", kind, f"llama.cpp llama-bench, GGUF {kind.upper()}")
      for kind in _llamacpp.GGUF_TYPES),
)}
COMPILED = ("hf-bf16-compiled", "torchao-int8")
# --isa: each level's caps for ATen's own kernels and oneDNN (xlaunch's kernels take the level's name)
ISA_CAPS = {"avx2": ("avx2", "AVX2"), "avx512": ("avx512", "AVX512_CORE"),
            "avx512_vnni": ("avx512", "AVX512_CORE_VNNI"), "avx512_bf16": ("avx512", "AVX512_CORE_BF16")}
# --instances: xlaunch's routes, each beside the llama.cpp route of its precision
LOADS = ("checkpoint", "packed", "decoder")
INSTANCE_PAIRS = {"xlaunch-bf16": "llamacpp-bf16", "xlaunch-int8": "llamacpp-q8_0", "xlaunch-int4": "llamacpp-q4_0"}


def isa_env(isa: Optional[str]) -> dict[str, str]:
    """The environment that caps a torch process at ``isa`` (empty for the CPU's own level)."""
    if isa is None:
        return {}
    aten, onednn = ISA_CAPS[isa]
    return {"XLAUNCH_CPU_ISA": isa, "ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}


def list_routes() -> str:
    return "\n".join(f"{r.name:18s} {r.engine:8s} vs llamacpp-{r.precision:5s} {r.what}"
                     + ("" if r.quick else "   (not in --quick)") for r in ROUTES.values())


def long_prompt(prompt: int, batch: int) -> bool:
    """From 1024 prompt tokens in all, a round times each prefill (and generate) once, not 3 times."""
    return prompt * batch >= 1024
