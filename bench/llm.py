"""LLM decoding side by side: Hugging Face eager fp32 and bf16, HF compiled with a static cache
(bf16, and torchao int8 weight-only), ``xlaunch.llm.optimize`` (bf16, int8, int4) and llama.cpp's
``llama-bench`` (F32, BF16, Q8_0, Q4_0) on the same weights, at 1 and 2 threads.

    .venv/bin/python bench/llm.py [--quick] [--threads 1,2] [--routes hf-fp32,llamacpp-bf16,...]
                                  [--shape llama-168m | --model PATH]
                                  [--rounds 5] [--prompt 32] [--new-tokens 48] [--batch 1] [--no-llamacpp]
                                  [--json PATH] [--lock PATH] [--list] [--instances 1,2] [--isa avx2]

The model is a preset shape (``--shape``, default ``llama-168m``: the published configs of
Llama-3.2-1B/3B, Qwen2.5-0.5B/1.5B and Mistral-7B-v0.1 in xlaunch/llm/shapes.py) with random weights
(normal(0, 0.02)), written once as a Hugging Face checkpoint with a sentencepiece tokenizer (trained
on generated words), or a user's checkpoint (``--model PATH``); it is converted to GGUF with
llama.cpp's own ``convert_hf_to_gguf.py``; llama.cpp is built from the tree vendored in the
``llama-cpp-python`` sdist. All of it is cached (bench/_llamacpp.py, bench/_llm_model.py). Before
anything starts, the memory and disk the run needs are estimated from the config and compared with
MemAvailable and the free disk: a shape that does not fit is refused with one line (exit status 2).

Each torch route runs in its own process (its threads and its peak RSS are its own), set up and
warmed once (a compiled route's first call takes about 30 s), then timed in interleaved rounds
with the llama.cpp rows (order reversed every other round; each round holds the bench lock).
Per round, a torch route times a forward over the prompt (prefill; logits of the last position only,
as ``generate``'s own prefill and llama-bench's ``-p`` compute) and greedy ``generate`` of
1 and N new tokens: decode tokens/s = (N - 1) / (t_N - t_1), each t the fastest of 3 (t_1) or 2
(t_N) runs in the round. From 1024 prompt tokens in all (prompt x batch), one ``generate`` a round
instead, its tokens time-stamped by a streamer: prefill = start to first token, decode = first to last
token (two long prefills differ by more than the N tokens take), and one llama-bench repetition. The
generation config has no EOS token, so every route makes exactly N tokens without an EOS check or a
minimum-length logits processor (llama-bench runs neither; with
``min_new_tokens`` each step paid a ``torch.isin`` over the vocabulary).
llama-bench times prefill (``-p P``) and decode (``-n N-1 -d P+1``: the same context lengths) as
two runs. Reported: medians over rounds, and the median of the per-round ratios to llama.cpp at
the same precision.

``--batch B`` decodes B sequences of ``--prompt`` random tokens together: the torch routes in one
``generate`` call of B rows, llama.cpp by ``llama-batched-bench -npp P -ntg N -npl B`` (prompts not
shared); both report aggregate tokens/s (B x tokens / time), prefill and decode.

``--instances k`` (a list, e.g. ``1,2``) runs each xlaunch route as k instances of ``xlaunch --ninstances k``
mapping one packed file, and k llama-bench processes pinned by ``taskset`` to the same cores (from
``xlaunch --dry-run --json``); it reports aggregate decode tokens/s and the memory the k hold together
(bench/_llm_instances.py). ``--share-imports torch,xlaunch.llm`` starts them with that xlaunch option: forked
from one process that imported those modules once.

``--isa LEVEL`` (``avx2``, ``avx512``, ``avx512_vnni``, ``avx512_bf16``) runs both sides as a CPU of that level
would: the torch routes with ``XLAUNCH_CPU_ISA``, ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` capped
there (xlaunch's defaults follow: fp32 activations below ``avx512_bf16``), llama.cpp built for that level
with its native build off (AVX-VNNI off at ``avx2``). On a Zen 4 or 5, ``--isa avx2`` shows the code an AVX2
machine runs; the ratios are this CPU's (its caches and memory), not that machine's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

import _llamacpp  # noqa: E402
import _llm_instances  # noqa: E402
import _llm_model  # noqa: E402
from _args import modules  # noqa: E402
from _machine_bench import int_list, median, paired_ratio  # noqa: E402

REPLY = "@@xlaunch-bench "                # a worker's replies on stdout start with this


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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the routes and exit")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 24 new tokens, no hf-bf16-compiled")
    parser.add_argument("--routes", help="comma-separated routes (--list); default: all (--quick: its set)")
    parser.add_argument("--threads", type=int_list, help="thread counts (default 1,2; with --instances: 1)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5, --quick 2)")
    parser.add_argument("--shape", help="a preset shape with random weights (default llama-168m; "
                        "xlaunch/llm/shapes.py: llama-3.2-1b, llama-3.2-3b, qwen2.5-0.5b, qwen2.5-1.5b, mistral-7b-v0.1)")
    parser.add_argument("--model", help="a Hugging Face checkpoint directory (config.json + *.safetensors) instead")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--new-tokens", type=int, help="generated tokens (default 48, --quick 24)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1): aggregate "
                        "tokens/s, llama.cpp by llama-batched-bench when above 1")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp (no build, no GGUF)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--lock", default="/tmp/xlaunch-bench.lock" if os.path.exists("/tmp/xlaunch-bench.lock") else "",
                        help="flock this file around each timed round ('' for none; default: "
                             "/tmp/xlaunch-bench.lock when it exists)")
    parser.add_argument("--instances", type=int_list, help="run k copies at once, each on its own cores: xlaunch "
                        "routes through xlaunch --ninstances k (one shared packed file), llama.cpp pinned the same; "
                        "a list (1,2) runs each k")
    parser.add_argument("--share-imports", metavar="MODULES", type=modules,
                        help="with --instances: xlaunch --share-imports MODULES (e.g. torch,xlaunch.llm): the copies "
                             "are forked from one process that imported them")
    parser.add_argument("--load", choices=LOADS, default="checkpoint",
                        help="how the xlaunch routes load (default checkpoint: from_pretrained streams the checkpoint; "
                             "packed: from_pretrained maps a packed file written once; decoder: load_decoder maps it, "
                             "no transformers in the process). With --instances, checkpoint means packed")
    parser.add_argument("--isa", choices=list(ISA_CAPS),
                        help="run both sides at this ISA level, as a CPU of that level would (see the top)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)      # internal: one torch route's process
    parser.add_argument("--instance-worker", action="store_true", help=argparse.SUPPRESS)   # internal: one instance
    parser.add_argument("--pack", help=argparse.SUPPRESS)        # internal: write a route's packed file
    parser.add_argument("--packed", help=argparse.SUPPRESS)
    parser.add_argument("--sync", help=argparse.SUPPRESS)
    parser.add_argument("--make-model", help=argparse.SUPPRESS)  # internal: write a preset's checkpoint
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.threads = args.threads or ([1] if args.instances else [1, 2])
    args.rounds = (2 if args.quick else 5) if args.rounds is None else args.rounds          # 0 is refused below
    args.new_tokens = (24 if args.quick else 48) if args.new_tokens is None else args.new_tokens
    if args.new_tokens < 2 or args.prompt < 1 or args.rounds < 1:
        parser.error("--new-tokens must be at least 2, --prompt and --rounds at least 1")
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, not {args.batch}")
    if args.batch > 1 and args.instances:
        parser.error(f"--batch {args.batch} and --instances exclude each other (one batched process, or k copies "
                     "at batch 1)")
    if args.shape and args.model:
        parser.error("--shape and --model exclude each other")
    if args.share_imports and not args.instances:
        parser.error("--share-imports applies to --instances (the copies xlaunch starts)")
    if args.isa and not (args.worker or args.instance_worker or args.pack):
        from xlaunch._isa_levels import chosen_level

        try:
            chosen_level(cap=args.isa)
        except ValueError as error:
            parser.error(f"--isa {args.isa}: {str(error).split(': ', 1)[1]}")
    if args.routes:
        names = [name.strip() for name in args.routes.split(",") if name.strip()]
        unknown = [name for name in names if name not in ROUTES]
        if unknown:
            parser.error(f"--routes: unknown {', '.join(unknown)} (known: {', '.join(ROUTES)})")
        if args.instances and set(names) - set(INSTANCE_PAIRS) - set(INSTANCE_PAIRS.values()):
            parser.error(f"--instances runs {', '.join(n for pair in INSTANCE_PAIRS.items() for n in pair)} only, "
                         f"not {', '.join(sorted(set(names) - set(INSTANCE_PAIRS) - set(INSTANCE_PAIRS.values())))}")
    elif args.instances:
        names = [name for pair in INSTANCE_PAIRS.items() for name in pair]
    else:
        names = [name for name, route in ROUTES.items() if route.quick or not args.quick]
    if args.no_llamacpp:
        names = [name for name in names if ROUTES[name].engine != "llamacpp"]
    args.route_names = names
    return args


def isa_env(isa: Optional[str]) -> dict[str, str]:
    """The environment that caps a torch process at ``isa`` (empty for the CPU's own level)."""
    if isa is None:
        return {}
    aten, onednn = ISA_CAPS[isa]
    return {"XLAUNCH_CPU_ISA": isa, "ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}


def list_routes() -> str:
    return "\n".join(f"{r.name:18s} {r.engine:8s} vs llamacpp-{r.precision:5s} {r.what}"
                     + ("" if r.quick else "   (not in --quick)") for r in ROUTES.values())


# -- one torch route (the worker process) --------------------------------------------------------
def reply(payload: dict[str, Any]) -> None:
    print(REPLY + json.dumps(payload), flush=True)


@contextlib.contextmanager
def heartbeat(what: str, every: float = 10.0) -> Iterator[None]:
    """A progress line every ``every`` seconds while the block runs (compiles, loads)."""
    import threading

    stop, start = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            print(f"      {what}: {time.monotonic() - start:.0f} s ...", flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def xlaunch_from_pretrained() -> Any:
    """``xlaunch.llm.from_pretrained``, looked up lazily; ``LookupError(reason)`` while it is not there."""
    try:
        import xlaunch.llm

        found = xlaunch.llm.from_pretrained
    except Exception as error:   # not merged yet, or its imports fail
        raise LookupError(f"xlaunch.llm.from_pretrained does not import ({type(error).__name__}: {str(error)[:160]})") from None
    if not callable(found):
        raise LookupError(f"xlaunch.llm.from_pretrained is not callable: {found!r}")
    return found


def prepare(route: str, folder: Path, packed: Optional[Path] = None, load: str = "checkpoint") -> Any:
    """The route's model; raises ``LookupError(reason)`` when the route cannot run here. With ``packed`` (an
    xlaunch route), the packed file of ``folder``: written when missing or stale, then mapped (``load``
    "decoder": by ``xlaunch.llm.load_decoder``, which imports no transformers)."""
    import torch

    if route.startswith("xlaunch-") and load == "decoder":
        try:
            import xlaunch.llm

            return xlaunch.llm.load_decoder(packed)
        except Exception as error:
            raise LookupError(f"load_decoder raised {type(error).__name__}: {error}") from None
    from transformers import AutoModelForCausalLM

    if route.startswith("xlaunch-"):
        activations, weights = _llm_model.XLAUNCH_ROUTES[route]
        load = xlaunch_from_pretrained()
        try:
            # streamed into the packed form (no full-precision copy); fp32 and bf16 weights in their own dtype,
            # INT8/INT4 in the CPU's default activations (bf16 with native bf16, else fp32)
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[activations]
            if packed is not None:
                return load(packed, source=folder, dtype=dtype, weights=weights)
            return load(folder, dtype=dtype, weights=weights)
        except Exception as error:
            raise LookupError(f"from_pretrained raised {type(error).__name__}: {error}") from None
    dtype = torch.float32 if route == "hf-fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    if route == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
    if route in COMPILED:
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
        compile_config._compile_all_devices = True       # generate compiles on CUDA only otherwise
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = compile_config
    return model


def worker(route: str, folder: Path, prompt_len: int, new_tokens: int, batch: int = 1,
           packed: Optional[Path] = None, load: str = "checkpoint") -> None:
    """Set up ``route``, warm it, then answer ``round`` (timings) and ``quit`` (peak RSS) on stdin. ``packed``:
    an xlaunch route's packed file, loaded as ``load`` says (the decoder's process never imports transformers)."""
    import logging
    import warnings

    import torch

    standalone = route.startswith("xlaunch-") and load == "decoder"
    warnings.filterwarnings("ignore")
    if not standalone:
        import transformers

        logging.getLogger("transformers").setLevel(logging.ERROR)
        transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    start = time.perf_counter()
    try:
        model = prepare(route, folder, packed if route.startswith("xlaunch-") else None, load)
    except LookupError as error:
        reply({"unavailable": str(error)})
        return
    setup_s = time.perf_counter() - start
    _llm_instances.without_end_of_sequence(model)      # exactly N tokens, no per-step EOS work (see the top)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)

    def generate(count: int, streamer: Any = None) -> float:
        begin = time.perf_counter()
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=count,
                             do_sample=False, pad_token_id=0, streamer=streamer)
        seconds = time.perf_counter() - begin
        if out.shape[1] != prompt_len + count:
            raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} new tokens, not {count}")
        return seconds

    def timed_generate(count: int) -> tuple[float, float]:
        """One ``generate`` with a time stamp per token (a streamer): (start -> first token: the prefill,
        first -> last token: N - 1 decode steps). A long prompt's prefill varies by more than N tokens
        take, so t_N - t_1 of two separate runs would measure that variance, not the decode."""
        stamps: list[float] = []

        class Stamps(streamer_base()):
            def put(self, value: Any) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        begin = time.perf_counter()
        generate(count, Stamps())
        if len(stamps) != count + 1:              # the prompt's put, then one a token
            raise RuntimeError(f"generate's streamer saw {len(stamps) - 1} new tokens, not {count}")
        return stamps[1] - begin, stamps[-1] - stamps[1]

    def prefill() -> float:
        begin = time.perf_counter()
        model(input_ids=prompt, attention_mask=mask, logits_to_keep=1)    # the last position's logits, as
        return time.perf_counter() - begin                                  # generate's prefill and llama-bench -p

    long = long_prompt(prompt_len, batch)
    try:
        with torch.inference_mode():
            slow = route in COMPILED
            with heartbeat("compiling") if slow else contextlib.nullcontext():
                first_s = generate(new_tokens)       # the longest first: a static cache is sized once
            if not long:                             # a long prompt's first call has warmed every kernel
                generate(1)
                prefill()
            choice = sys.modules.get("xlaunch.llm.kernel_choice")     # an xlaunch route's measured choice
            reply({"ready": True, "setup_s": setup_s, "first_call_s": first_s,
                   "dense_rows": own_threads(choice.thresholds(), torch.get_num_threads()) if choice else {}})
            for line in sys.stdin:
                if line.strip() != "round":
                    break
                if long:      # one generate: its prefill, and its decode steps timed token by token
                    prefill_s, decode_s = timed_generate(new_tokens)
                    reply({"prefill_s": prefill_s, "decode_s": decode_s})
                    continue
                prefill_s = median(prefill() for _ in range(3))
                # the fastest of a few runs each: one stall in a single t_1 or t_N would skew (N-1)/(t_N-t_1)
                gen1_s = min(generate(1) for _ in range(3))
                reply({"prefill_s": prefill_s, "gen1_s": gen1_s, "genN_s": min(generate(new_tokens) for _ in range(2))})
    except Exception as error:       # a route that breaks mid-way is reported, not fatal to the bench
        reply({"unavailable": f"failed: {type(error).__name__}: {str(error)[:300]}"})
        return
    status = Path("/proc/self/status").read_text()
    fields = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith(("VmHWM", "VmRSS"))}
    reply({"peak_rss_mib": fields.get("VmHWM", 0) / 1024, "rss_mib": fields.get("VmRSS", 0) / 1024,
           "transformers_imported": "transformers" in sys.modules})


def streamer_base() -> type:
    """transformers' ``BaseStreamer`` where transformers is already imported (generate checks it), else object:
    a standalone decoder's process stays without it."""
    module = sys.modules.get("transformers.generation.streamers")
    if module is None and "transformers" in sys.modules:
        from transformers.generation import streamers as module
    return object if module is None else module.BaseStreamer


def own_threads(dense_rows: dict[str, dict[str, Optional[int]]], threads: int) -> dict[str, dict[str, Optional[int]]]:
    """The choices measured at ``threads`` (the per-machine cache also holds other thread counts' shapes)."""
    return {level: {key: rows for key, rows in known.items() if key.endswith(f":t{threads}")}
            for level, known in dense_rows.items()}


def dense_rows_lines(dense_rows: dict[str, dict[str, Optional[int]]]) -> list[str]:
    """One line per kernel level of what xlaunch.llm.kernel_choice chose in a worker: per weight shape,
    the row count from which ATen's GEMM ran (or never), named by weight kind and shape (the cache holds every
    route's that ran on this level)."""
    return [f"ATen's GEMM against the {level} kernels: " + ", ".join(
        f"{' '.join(key.split(':')[:2])} {'never' if rows is None else f'from {rows} rows'}"
        for key, rows in sorted(known.items()))
        for level, known in sorted(dense_rows.items())]


# -- the orchestrator ------------------------------------------------------------------------------
class Worker:
    """One torch route in its own process, ``OMP_NUM_THREADS`` set before torch loads."""

    def __init__(self, route: str, folder: Path, threads: int, args: argparse.Namespace,
                 packed: Optional[Path] = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **isa_env(args.isa)}
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"xlaunch-bench-llm-{route}-", suffix=".log")
        loading = ["--packed", str(packed), "--load", args.load] if packed is not None else []
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", route, "--model-dir", str(folder), "--prompt", str(args.prompt),
             "--new-tokens", str(args.new_tokens), "--batch", str(args.batch), *loading],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, stderr=self.log)

    def stderr_tail(self, lines: int = 12) -> str:
        """The end of the worker's stderr (library warnings go there, shown when a route fails)."""
        self.log.seek(0)
        return "\n".join("      ! " + line for line in self.log.read().splitlines()[-lines:])

    def answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            print("      | " + line.rstrip(), flush=True)     # the worker's own progress lines
        return {"unavailable": f"the worker exited ({self.process.wait()})"}

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return {"unavailable": "the worker exited"}
        return self.answer()

    def close(self) -> dict[str, Any]:
        answer = self.ask("quit") if self.process.poll() is None else {}
        self.process.wait()
        self.log.close()
        return answer


@contextlib.contextmanager
def bench_lock(path: str) -> Iterator[None]:
    """Hold ``flock(path)`` (shared with ``flock(1)`` users) for a timed round."""
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"    waiting for {path} (another timed run) ...", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_llamacpp(kinds: Sequence[str], model: _llm_model.BenchModel,
                     isa: Optional[str] = None) -> tuple[Path, dict[str, Path]]:
    print("llama.cpp: build" + (f" for the {isa} level" if isa else "") + " and GGUF files (cached under "
          f"{_llamacpp.cache_root()})", flush=True)
    bin_dir = _llamacpp.build(isa=isa)
    source = _llamacpp.source_dir()
    return bin_dir, {kind: _llamacpp.gguf_file(model.folder, kind, bin_dir, source, model.gguf_dir, model.q4_source())
                     for kind in kinds}


def long_prompt(prompt: int, batch: int) -> bool:
    """From 1024 prompt tokens in all, a round times each prefill (and generate) once, not 3 times."""
    return prompt * batch >= 1024


def measure_llamacpp(bin_dir: Path, gguf: Path, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.batch > 1:
        text, rss = _llamacpp.run_measured(_llamacpp.batched_bench_argv(bin_dir, gguf, threads, args.prompt,
                                                                         args.new_tokens, args.batch), "llama-batched-bench")
        got = _llamacpp.parse_batched_bench(text)
        return {"prefill_tps": got["prefill_tps"], "decode_tps": got["decode_tps"], "peak_rss_mib": rss}
    repeat = 1 if long_prompt(args.prompt, args.batch) else 3
    prefill, rss_a = _llamacpp.run_llama_bench(
        _llamacpp.llama_bench_argv(bin_dir, gguf, threads, "prefill", args.prompt, 0, repetitions=repeat))
    decode, rss_b = _llamacpp.run_llama_bench(
        _llamacpp.llama_bench_argv(bin_dir, gguf, threads, "decode", args.new_tokens - 1, args.prompt + 1, min(repeat, 2)))
    return {"prefill_tps": prefill["avg_ts"], "decode_tps": decode["avg_ts"], "peak_rss_mib": max(rss_a, rss_b)}


def run_threads(threads: int, args: argparse.Namespace, folder: Optional[Path],
                llama: Optional[tuple[Path, dict[str, Path]]],
                packed: Optional[dict[str, Optional[Path]]] = None) -> dict[str, dict[str, Any]]:
    """Every route at ``threads`` threads: set up the workers, then interleaved timed rounds (``packed``: the
    xlaunch routes' packed files, with ``--load packed`` or ``decoder``)."""
    rows: dict[str, dict[str, Any]] = {}
    workers: dict[str, Worker] = {}
    torch_routes = [name for name in args.route_names if ROUTES[name].engine == "torch"]
    print(f"\n== {threads} thread(s): setting up {len(torch_routes)} torch route(s)", flush=True)
    for index, name in enumerate(torch_routes, 1):
        note = " (torch.compile: about 30 s)" if name in COMPILED else ""
        print(f"  [{index}/{len(torch_routes)}] {name}{note} ...", flush=True)
        assert folder is not None
        if packed is not None and name.startswith("xlaunch-") and packed.get(name) is None:
            rows[name] = {"status": "unavailable: no packed file"}
            continue
        worker_ = Worker(name, folder, threads, args, None if packed is None else packed.get(name))
        ready = worker_.answer()
        if "unavailable" in ready:
            print(f"      unavailable: {ready['unavailable']}", flush=True)
            if ready["unavailable"].startswith("failed") or worker_.process.poll():
                print(worker_.stderr_tail(), flush=True)
            rows[name] = {"status": f"unavailable: {ready['unavailable']}"}
            worker_.close()
            continue
        print(f"      ready: load+optimize {ready['setup_s']:.1f} s, first generate {ready['first_call_s']:.1f} s",
              flush=True)
        for line in dense_rows_lines(ready.get("dense_rows", {})):
            print(f"      {line}", flush=True)
        workers[name] = worker_
        rows[name] = {"status": "ok", "setup_s": ready["setup_s"], "first_call_s": ready["first_call_s"],
                      "dense_rows": ready.get("dense_rows", {}), "prefill_tps": [], "decode_tps": [], "peak_rss_mib": 0.0}
    for name in args.route_names:
        if ROUTES[name].engine == "llamacpp":
            rows[name] = ({"status": "ok", "prefill_tps": [], "decode_tps": [], "peak_rss_mib": 0.0} if llama
                          else {"status": "unavailable: llama.cpp skipped"})
    timed = [name for name in args.route_names if rows[name]["status"] == "ok"]
    for round_index in range(args.rounds):
        order = timed if round_index % 2 == 0 else timed[::-1]
        with bench_lock(args.lock):
            began = time.monotonic()
            for name in order:
                row = rows[name]
                if row["status"] != "ok":
                    row["prefill_tps"].append(None)
                    row["decode_tps"].append(None)
                    continue
                time.sleep(0.1)          # the previous row's threads go idle
                if ROUTES[name].engine == "llamacpp":
                    assert llama is not None
                    try:
                        got = measure_llamacpp(llama[0], llama[1][ROUTES[name].precision], threads, args)
                    except (RuntimeError, ValueError) as error:
                        row["status"] = f"failed: {str(error)[:300]}"
                        print(f"    {name}: {row['status']}", flush=True)
                        continue
                    row["peak_rss_mib"] = max(row["peak_rss_mib"], got["peak_rss_mib"])
                else:
                    answer = workers[name].ask("round")
                    if "unavailable" in answer:
                        row["status"] = answer["unavailable"]
                        print(f"    {name}: {row['status']}\n{workers[name].stderr_tail()}", flush=True)
                        continue
                    decode_s = answer["decode_s"] if "decode_s" in answer else answer["genN_s"] - answer["gen1_s"]
                    got = {"prefill_tps": args.batch * args.prompt / answer["prefill_s"],
                           "decode_tps": args.batch * (args.new_tokens - 1) / max(decode_s, 1e-9)}
                row["prefill_tps"].append(got["prefill_tps"])
                row["decode_tps"].append(got["decode_tps"])
        summary = "  ".join(f"{name} {rows[name]['decode_tps'][-1]:.1f}" for name in order
                            if rows[name]["status"] == "ok" and rows[name]["decode_tps"][-1] is not None)
        print(f"  round {round_index + 1}/{args.rounds} ({time.monotonic() - began:.0f} s), decode tok/s: {summary}",
              flush=True)
    for name, worker_ in workers.items():
        last = worker_.close()
        rows[name]["peak_rss_mib"], rows[name]["end_rss_mib"] = last.get("peak_rss_mib", 0.0), last.get("rss_mib")
        rows[name]["transformers_imported"] = last.get("transformers_imported")
    return rows


def summarize(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Medians, and paired ratios to the llama.cpp row of the same precision (where it ran)."""
    out = {}
    for name, row in rows.items():
        if row["status"] != "ok":
            out[name] = {"status": row["status"]}
            continue
        peer = rows.get(f"llamacpp-{ROUTES[name].precision}")
        peer_ok = peer is not None and peer["status"] == "ok" and not name.startswith("llamacpp-")
        out[name] = {
            "status": "ok",
            "decode_tps": median(v for v in row["decode_tps"] if v is not None),
            "prefill_tps": median(v for v in row["prefill_tps"] if v is not None),
            "decode_vs_llamacpp": paired_ratio(row["decode_tps"], peer["decode_tps"]) if peer_ok else None,
            "prefill_vs_llamacpp": paired_ratio(row["prefill_tps"], peer["prefill_tps"]) if peer_ok else None,
            "peak_rss_mib": row["peak_rss_mib"],
            **{key: row[key] for key in ("end_rss_mib", "setup_s", "first_call_s", "dense_rows", "transformers_imported")
               if key in row},
            "decode_rounds": row["decode_tps"], "prefill_rounds": row["prefill_tps"],
        }
    return out


def table(threads: int, summary: dict[str, dict[str, Any]], batch: int = 1) -> str:
    def number(value: Optional[float], form: str) -> str:
        return "" if value is None else format(value, form)

    what = f"{threads} thread{'s' if threads > 1 else ''}" + (f", batch {batch}: aggregate" if batch > 1 else "")
    lines = [f"| route ({what}) | decode tok/s | vs llama.cpp | prefill tok/s "
             "| vs llama.cpp | peak RSS MiB | RSS at end MiB | first call s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in summary.items():
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']} | | | | | | |")
            continue
        lines.append(f"| {name} | {number(row['decode_tps'], '.1f')} | {number(row['decode_vs_llamacpp'], '.2f')} "
                     f"| {number(row['prefill_tps'], '.0f')} | {number(row['prefill_vs_llamacpp'], '.2f')} "
                     f"| {row['peak_rss_mib']:.0f} | {number(row.get('end_rss_mib'), '.0f')} "
                     f"| {number(row.get('first_call_s'), '.1f')} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    from _machine_bench import describe_machine, machine_line, node_cores

    from xlaunch.machine import current_machine

    here = current_machine()
    description = describe_machine(here, node_cores(here))
    print(machine_line(description), flush=True)
    return description


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(list_routes())
        return 0
    if args.make_model:
        _llm_model.make(args.make_model)
        return 0
    if args.instance_worker:
        _llm_instances.instance_worker(Path(args.packed), Path(args.sync), args.prompt, args.new_tokens, args.load)
        return 0
    if args.pack:           # each route's packed file, <packed>/<route>.xlp: written when missing or stale
        for route in args.pack.split(","):
            prepare(route, Path(args.model_dir), Path(args.packed) / f"{route}.xlp")
        return 0
    if args.worker:
        worker(args.worker, Path(args.model_dir), args.prompt, args.new_tokens, args.batch,
               Path(args.packed) if args.packed else None, args.load)
        return 0
    kinds = sorted({ROUTES[name].precision for name in args.route_names if ROUTES[name].engine == "llamacpp"},
                   key=_llamacpp.GGUF_TYPES.index)
    try:
        model = _llm_model.resolve(args.shape, args.model)
    except _llm_model.shapes.ShapeError as error:
        print(f"bench/llm.py: {error}", file=sys.stderr)
        return 2
    torch_routes = [name for name in args.route_names if ROUTES[name].engine == "torch"]
    needed = (_llm_model.need_instances(model, torch_routes, kinds, max(args.instances), args.prompt, args.new_tokens)
              if args.instances else _llm_model.need(model, torch_routes, kinds, args.prompt, args.new_tokens, args.batch))
    refused = _llm_model.footprint.refusal("bench/llm.py", model.name, needed,
                                           hint=" (try fewer --routes or a smaller --shape)")
    if refused:
        print(refused, file=sys.stderr)
        return 2
    if args.instances:
        return main_instances(args, model, kinds)
    description = machine()
    print(f"model: {model.name} ({model.shape.parameters() / 1e6:.1f}M parameters); routes: {', '.join(args.route_names)}; "
          f"threads {args.threads}; {args.rounds} rounds; prompt {args.prompt}, new tokens {args.new_tokens}, "
          f"batch {args.batch}; xlaunch loads {args.load}; " + (f"ISA capped at {args.isa}; " if args.isa else "") +
          f"lock {args.lock or 'none'}", flush=True)
    folder = _llm_model.written(model, __file__)
    llama = llamacpp_if_possible(kinds, model, args.isa)
    packed = None
    if args.load != "checkpoint":
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **isa_env(args.isa)}
        packed = _llm_instances.pack_all(args.route_names, model, __file__, env)
    from _machine_bench import write_results

    def save(final: bool) -> None:
        description["load_average_end"] = list(os.getloadavg())
        write_results(description, args.json, {
            "bench": "llm", "model": model.name, "config": model.config, "prompt": args.prompt,
            "new_tokens": args.new_tokens, "batch": args.batch, "rounds": args.rounds, "load": args.load,
            "isa": args.isa, "llamacpp": {"version": _llamacpp.VERSION, "cpu_key": _llamacpp.cpu_key()},
            "results": results}, final)

    results: dict[str, Any] = {}
    for threads in args.threads:
        results[str(threads)] = summarize(run_threads(threads, args, folder, llama, packed))
        save(final=False)
    print()
    for threads in args.threads:
        print(table(threads, results[str(threads)], args.batch) + "\n")
    save(final=True)
    return 0


def llamacpp_if_possible(kinds: Sequence[str], model: _llm_model.BenchModel, isa: Optional[str] = None) -> Any:
    """llama.cpp built and the model's GGUF files made for ``kinds``; None (with one line) when it cannot
    be: no compiler, no network. The torch rows still run."""
    if not kinds:
        return None
    try:
        return prepare_llamacpp(kinds, model, isa)
    except Exception as error:
        print(f"llama.cpp unavailable: {type(error).__name__}: {error}", flush=True)
        return None


def main_instances(args: argparse.Namespace, model: _llm_model.BenchModel, kinds: Sequence[str]) -> int:
    """``--instances``: plan every (k, threads) with xlaunch's dry run first (a refused one stops the run in
    one line), then pack, then each route's k copies at once."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **isa_env(args.isa),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        cpu_plans = _llm_instances.plans(args, __file__, env)
    except _llm_instances.PlanError as error:
        print(f"bench/llm.py: {error}", file=sys.stderr)
        return 2
    description = machine()
    print(f"model: {model.name} ({model.shape.parameters() / 1e6:.1f}M parameters); routes: {', '.join(args.route_names)}; "
          f"instances {args.instances}; threads {args.threads}; {args.rounds} rounds per instance; prompt {args.prompt}, "
          f"new tokens {args.new_tokens}", flush=True)
    _llm_model.written(model, __file__)
    llama = llamacpp_if_possible(kinds, model, args.isa)
    packed = _llm_instances.pack_all(args.route_names, model, __file__, env)
    from _machine_bench import write_results

    def save(results: dict[str, Any], final: bool) -> None:
        description["load_average_end"] = list(os.getloadavg())
        write_results(description, args.json, {
            "bench": "llm-instances", "model": model.name, "config": model.config, "prompt": args.prompt,
            "new_tokens": args.new_tokens, "rounds": args.rounds, "instances": args.instances, "threads": args.threads,
            "load": "decoder" if args.load == "decoder" else "packed",
            "isa": args.isa, "llamacpp": {"version": _llamacpp.VERSION, "cpu_key": _llamacpp.cpu_key()},
            "results": results}, final)

    with bench_lock(args.lock):
        results = _llm_instances.run(args, packed, llama, cpu_plans, __file__, env, median, _llamacpp, INSTANCE_PAIRS,
                                     checkpoint=lambda done: save(done, final=False))
    print("\n" + _llm_instances.tables(args, results, INSTANCE_PAIRS))
    save(results, final=True)
    return 0


if __name__ == "__main__":
    import _processes

    _processes.exit_on_sigterm()       # unwinds: the workers see their stdin close, their logs are removed
    _processes.survive_closed_stdout()
    sys.exit(main())
