"""Decode with a small random Llama built from a config (no download), optimized by xlaunch.llm.

    python examples/llm.py                          # the 168M-parameter model, batch 1, the CPU's dtype
    python examples/llm.py --weights int8 --batch 4
    python examples/llm.py --tiny --no-optimize     # a 2-layer model in seconds; plain Hugging Face
    xlaunch --ninstances 2 examples/llm.py          # each instance its own copy on its own cores
    xlaunch --auto-optimize --dtype bfloat16 examples/llm.py --no-optimize   # the launcher optimizes it

Prints ``prefill: X tokens/s`` (the prompt's forward) and ``decode: Y tokens/s`` (tokens after the
first, over ``generate``'s time after the prefill), per instance with its CPUs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

CPUS = sorted(os.sched_getaffinity(0))      # before torch: its OpenMP may pin the main thread
MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=16)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 128-wide model (for tests)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="activations; auto: bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--weights", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--no-optimize", action="store_true", help="plain Hugging Face (in the dtype)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("batch", "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    import logging

    for noisy in ("torchao", "torch.utils._pytree"):   # transformers imports torchao, which logs CUDA-only misses
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(**(TINY if args.tiny else MODEL), tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    if args.no_optimize:
        if args.dtype == "auto":
            import xlaunch.llm

            dtype = xlaunch.llm.default_dtype()
        else:
            dtype = getattr(torch, args.dtype)
        model = model.to(dtype)
        print(f"not optimized ({str(dtype).removeprefix('torch.')})")
    else:
        import xlaunch.llm

        started = time.perf_counter()
        xlaunch.llm.optimize(model, dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
                             weights=None if args.weights == "none" else args.weights)
        ran = str(model.config.dtype).removeprefix("torch.")
        print(f"optimized ({ran}, weights {args.weights}) in {time.perf_counter() - started:.2f} s")
    ids = torch.randint(1, config.vocab_size, (args.batch, args.prompt_tokens))
    fixed = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def generate(tokens: int) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **fixed)
        assert out.shape == (args.batch, args.prompt_tokens + tokens), out.shape
        return time.perf_counter() - started

    generate(2)                                         # warm-up: first-call costs out of the figures
    prefill = generate(1)
    total = generate(args.new_tokens + 1)
    decode_s = max(total - prefill, 1e-9)
    index = os.environ.get("XLAUNCH_INSTANCE_INDEX", "-")
    print(f"instance {index} cpus {','.join(map(str, CPUS))} threads {torch.get_num_threads()} batch {args.batch}")
    print(f"prefill: {args.batch * args.prompt_tokens / prefill:.1f} tokens/s")
    print(f"decode: {args.batch * args.new_tokens / decode_s:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
