"""bench/llm.py ``--worker ROUTE``: one torch route in its own process. It sets the route up, warms it, then
answers ``round`` (timings) and ``quit`` (peak RSS) on stdin, each reply a line starting with ``REPLY``."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import _llm_instances
import _llm_model
from _llm_routes import COMPILED, long_prompt
from _machine_bench import median

REPLY = "@@xlaunch-bench "                # a worker's replies on stdout start with this


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
