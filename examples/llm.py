"""Decode with a random-weight decoder of a real shape (no download) or your checkpoint, optimized by xlaunch.llm.

    python examples/llm.py                          # the 168M-parameter Llama (--shape llama-168m), batch 1
    python examples/llm.py --shape llama-3.2-1b --weights int4   # Llama-3.2-1B's config, random weights
    python examples/llm.py --model ~/models/Qwen2.5-0.5B         # a Hugging Face checkpoint directory
    python examples/llm.py --weights int8 --batch 4
    python examples/llm.py --tiny --no-optimize     # a 2-layer model in seconds; plain Hugging Face
    xlaunch --ninstances 2 examples/llm.py          # each instance its own copy on its own cores
    xlaunch --ninstances 2 examples/llm.py --weights int8 --packed /tmp/m.xlp   # one mapped copy, no transformers
    xlaunch --ninstances 4 examples/llm.py --weights int8 --packed /tmp/m.xlp --node-copy   # one per NUMA node
    xlaunch --auto-optimize --dtype bfloat16 examples/llm.py --no-optimize   # the launcher optimizes it

A preset (``--shape``, xlaunch/llm/shapes.py) is written as a safetensors checkpoint of random
weights, one slice at a time (from 256 MiB up cached under ~/.cache/xlaunch/llm-shapes, else in a
temporary folder), then streamed into the packed form by ``xlaunch.llm.from_pretrained``
(``--no-optimize``: loaded by transformers). Before that the memory it needs is compared with
MemAvailable: a shape that does not fit is refused with one line, exit status 2.
``--packed FILE`` decodes a packed file with ``xlaunch.llm.load_decoder`` instead: transformers is never
imported by this process, and instances started by ``xlaunch --ninstances N`` map the one file. A missing
or stale file (another checkpoint, precision or kernel level) is written first by a child process, under a
lock next to it, so N instances write it once; anything else at that name (a directory, a device, a link, a
file that is not a packed file) is refused with one line, exit status 2, and left as it is.
Prints ``prefill: X tokens/s`` (the prompt's forward, to the first new token) and ``decode: Y tokens/s``
(the ``--new-tokens`` tokens after the first, from a streamer's time stamps in the same ``generate``),
per instance with its CPUs.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _quiet_interrupt(kind: type, value: BaseException, tb: object) -> None:
    """Ctrl-C (also while torch imports, or made another error by a library it interrupted) ends the run
    without a traceback."""
    cause: object = value
    for _ in range(16):
        if cause is None or isinstance(cause, KeyboardInterrupt):
            break
        cause = cause.__cause__ or cause.__context__   # type: ignore[attr-defined]
    if not isinstance(cause, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)   # type: ignore[arg-type]


if __name__ == "__main__":   # as a program (not when a test imports it)
    sys.excepthook = _quiet_interrupt

CPUS = sorted(os.sched_getaffinity(0))      # before torch: its OpenMP may pin the main thread

from xlaunch.llm import footprint, shapes  # noqa: E402  (no torch)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=shapes.DEFAULT,
                        help=f"a preset: {', '.join(shapes.PRESETS)} (default {shapes.DEFAULT})")
    parser.add_argument("--model", help="a Hugging Face checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny: a 2-layer, 128-wide model (for tests)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="activations; auto: bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--weights", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--no-optimize", action="store_true", help="plain Hugging Face (in the dtype)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--packed", metavar="FILE", help="decode this packed file with xlaunch.llm.load_decoder "
                        "(no transformers; written first when missing or stale)")
    parser.add_argument("--node-copy", action="store_true", help="with --packed: map the copy of this process's "
                        "NUMA node (written once per node beside the file; the file itself on one node)")
    args = parser.parse_args(argv)
    if args.node_copy and not args.packed:
        parser.error("--node-copy needs --packed")
    if args.packed and args.no_optimize:
        parser.error("--packed and --no-optimize exclude each other")
    if args.no_optimize and args.weights != "none":     # plain Hugging Face runs the weights in the dtype
        parser.error(f"--weights {args.weights} needs xlaunch.llm; --no-optimize runs the model's weights in --dtype")
    for name in ("batch", "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tiny:
        args.shape = "tiny"
    return args


def need(args: argparse.Namespace, config: dict) -> footprint.Need:
    """The memory of the run's largest phase (writing the checkpoint, or loading and decoding) and the disk it writes."""
    shape = shapes.Shape(config)
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(args.dtype) or footprint.default_activations()
    tokens = args.prompt_tokens + args.new_tokens + 1
    run = footprint.TORCH_PROCESS_BYTES + footprint.kv_cache_bytes(shape, tokens, args.batch, dtype) \
        + footprint.activation_bytes(shape, args.prompt_tokens, args.batch)
    if args.no_optimize:      # transformers maps the checkpoint and holds the model in the dtype
        run += shapes.checkpoint_bytes(config) + footprint.dense_bytes(shape, dtype)
        what = f"the {dtype} model, the mapped checkpoint and the KV cache"
    else:
        weights = None if args.weights == "none" else args.weights
        run += footprint.packed_bytes(shape, dtype, weights) + footprint.streamed_load_bytes(shape, dtype)
        what = f"packed {weights or dtype} weights and the KV cache"
    phases = [(what, run)]
    disk, where = 0, None
    if not args.model:
        folder = shapes.cached_checkpoint(args.shape, args.seed)
        if not (folder / "model.safetensors").is_file():
            big = shapes.checkpoint_bytes(config) >= shapes.CACHE_FROM_BYTES
            disk, where = shapes.checkpoint_bytes(config), str(folder.parent if big else tempfile.gettempdir())
            phases.append(("writing the checkpoint", footprint.TORCH_PROCESS_BYTES + 3 * shapes.CHUNK_BYTES))
    memory, what = footprint.peak(phases)
    return footprint.Need(memory, what, disk, where)


WRITE_PACKED = """
import sys
sys.excepthook = lambda kind, *rest: None if issubclass(kind, KeyboardInterrupt) else sys.__excepthook__(kind, *rest)
import torch
from xlaunch.llm import loader, packed_file
path, source, dtype, weights = sys.argv[1:]
dtype, weights = None if dtype == "auto" else getattr(torch, dtype), None if weights == "none" else weights
loader.warn_if_bf16_is_slow(dtype, "xlaunch.llm.from_pretrained")
try:
    packed = loader.load_checkpoint(source, dtype, weights)
except ValueError as error:      # a checkpoint it cannot load (no weights, a config it cannot build): one line
    print(f"examples/llm.py: --model: {str(error).splitlines()[0]}", file=sys.stderr)
    sys.exit(2)
packed_file.save_packed(packed, path, source=source)   # the parent maps it
"""


def open_packed(args: argparse.Namespace, folder: Path, name: str):
    """``--packed``: the file's decoder, the file written first (by a child process, under a lock beside it)
    when it is missing or does not stand for ``folder`` at this precision and kernel level."""
    import torch
    from xlaunch.llm import packed_file, standalone

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    weights = None if args.weights == "none" else args.weights
    path = Path(args.packed)
    refused = _not_replaceable(path, packed_file.MAGIC, written=False)
    if refused:                                          # before the lock: /tmp's would be /tmp.lock
        print(f"examples/llm.py: --packed: {refused}", file=sys.stderr)
        raise SystemExit(2)
    lock_path = path.with_name(path.name + ".lock")
    try:                                                 # a link planted at the lock's name is refused, not followed
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        print(f"examples/llm.py: --packed: cannot open the lock {lock_path}: {error.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    with os.fdopen(lock_fd) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stale = packed_file.stale_reason(path, folder, dtype, weights, 128)
        refused = stale and _not_replaceable(path, packed_file.MAGIC, written=True)
        if refused:
            print(f"examples/llm.py: --packed: {refused}", file=sys.stderr)
            raise SystemExit(2)
        if stale is not None:
            started = time.perf_counter()
            written = subprocess.run([sys.executable, "-c", WRITE_PACKED, str(path), str(folder), args.dtype,
                                      args.weights])
            if written.returncode == 2:      # the checkpoint cannot be loaded: the child said why, in one line
                raise SystemExit(2)
            if written.returncode != 0:
                raise SystemExit(f"examples/llm.py: writing {path} failed (exit status {written.returncode})")
            print(f"packed file written ({stale.split(': ')[-1]}) in {time.perf_counter() - started:.2f} s: {path}")
    started = time.perf_counter()
    decoder = standalone.load_decoder(path, dtype=dtype, weights=weights, node_copy=args.node_copy)
    held = "imported" if "transformers" in sys.modules else "not imported"
    mapped = "" if decoder.mapped == path else f" (its node's copy {decoder.mapped.name})"
    print(f"decoder ({str(decoder.dtype).removeprefix('torch.')}, weights {decoder.weights}) mapped in "
          f"{time.perf_counter() - started:.2f} s: {path}{mapped} from {name}; transformers {held}")
    return decoder


def _not_replaceable(path: Path, magic: bytes, written: bool) -> str:
    """Why ``--packed`` must not write at ``path`` ("" when it may): a directory, a device, a FIFO; and, when it
    is about to be written, a link (never written through) or a file that is not a packed file (a checkpoint,
    a script: a stale packed file is replaced, anything else is the user's)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return f"{path} is a link to nothing; name the file itself" if written and path.is_symlink() else ""
    except OSError as error:
        return f"cannot read {path}: {error.strerror}"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file; name a packed file (it is written when missing)"
    if not written:
        return ""
    if path.is_symlink():
        return f"{path} is a link and would be written; name the file itself"
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(magic))
    except OSError as error:
        return f"cannot read {path}: {error.strerror}"
    if head != magic:
        return f"{path} is not an xlaunch packed file; not replacing it (remove it, or name another file)"
    return ""


def load(args: argparse.Namespace, folder: Path, name: str):
    """The model to decode: the packed file's decoder (``--packed``), plain Hugging Face (``--no-optimize``), or
    ``xlaunch.llm.from_pretrained``'s optimized model."""
    import torch

    if args.packed:
        return open_packed(args, folder, name)
    if args.no_optimize:
        from transformers import AutoModelForCausalLM

        if args.dtype == "auto":
            import xlaunch.llm

            dtype = xlaunch.llm.default_dtype()
        else:
            dtype = getattr(torch, args.dtype)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        print(f"not optimized ({str(dtype).removeprefix('torch.')})")
        return model
    import xlaunch.llm

    started = time.perf_counter()
    model = xlaunch.llm.from_pretrained(folder, dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
                                        weights=None if args.weights == "none" else args.weights)
    ran = str(model.config.dtype).removeprefix("torch.")
    head = model.lm_head.kind if args.weights == "int4" else ""     # INT6 where the kernels run it, else INT8
    print(f"optimized ({ran}, weights {args.weights}{f', lm_head {head}' if head else ''}) in "
          f"{time.perf_counter() - started:.2f} s: {name}")
    return model


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        config = shapes.read_config(args.model) if args.model else shapes.preset(args.shape)
    except shapes.ShapeError as error:
        print(f"examples/llm.py: {error}", file=sys.stderr)
        return 2
    name = args.model or args.shape
    refused = footprint.refusal("examples/llm.py", name, need(args, config))
    if refused:
        print(refused, file=sys.stderr)
        return 2
    import logging

    for noisy in ("torchao", "torch.utils._pytree"):   # transformers imports torchao, which logs CUDA-only misses
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import torch

    scratch = tempfile.TemporaryDirectory(prefix="xlaunch-llm-example-")
    folder = Path(args.model) if args.model else shapes.ensure_checkpoint(args.shape, args.seed, scratch.name)
    try:
        model = load(args, folder, name)
    except (ValueError, OSError) as error:   # the user's checkpoint (no weights, a config it cannot build): one line
        if not args.model:
            raise
        print(f"examples/llm.py: --model: {(str(error).splitlines() or [type(error).__name__])[0]}", file=sys.stderr)
        return 2
    vocab = model.spec.vocab_size if args.packed else model.config.vocab_size
    scratch.cleanup()                  # the model no longer reads it
    ids = torch.randint(1, vocab, (args.batch, args.prompt_tokens))
    fixed = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))

    class Stamps:
        """A streamer that notes when the prompt and each new token come out of generate."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(tokens: int) -> tuple[float, float]:
        """(start -> first new token: the prefill, first -> last new token: ``tokens - 1`` decode steps), from one
        call: two separate calls would measure their own variation as much as the decode."""
        stamps = Stamps()
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, streamer=stamps, **fixed)
        assert out.shape == (args.batch, args.prompt_tokens + tokens), out.shape
        assert len(stamps.times) == tokens + 1, len(stamps.times)       # the prompt, then each step's tokens
        return stamps.times[1] - started, stamps.times[-1] - stamps.times[1]

    generate(2)                                         # warm-up: first-call costs out of the figures
    prefill, decode_s = generate(args.new_tokens + 1)
    index = os.environ.get("XLAUNCH_INSTANCE_INDEX", "-")
    print(f"instance {index} cpus {','.join(map(str, CPUS))} threads {torch.get_num_threads()} batch {args.batch}")
    print(f"prefill: {args.batch * args.prompt_tokens / prefill:.1f} tokens/s")
    print(f"decode: {args.batch * args.new_tokens / decode_s:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
        sys.stdout.flush()        # inside the try: a closed pipe found at exit is the same case
    except BrokenPipeError:   # stdout closed early (`| head`): stop quietly, as a Unix tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing left to flush at exit
        status = 1
    sys.exit(status)
