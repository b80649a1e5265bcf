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
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]

import _llamacpp  # noqa: E402
import _llm_instances  # noqa: E402
import _llm_model  # noqa: E402
from _args import modules  # noqa: E402
from _llm_rounds import (  # noqa: E402,F401  (the tests use dense_rows_lines here)
    bench_lock, dense_rows_lines, prepare_llamacpp, run_threads, summarize, table)
from _llm_routes import INSTANCE_PAIRS, ISA_CAPS, LOADS, ROUTES, isa_env, list_routes  # noqa: E402
from _llm_worker import REPLY, own_threads, prepare, worker  # noqa: E402,F401  (REPLY, own_threads: the tests)
from _machine_bench import int_list, median  # noqa: E402


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
