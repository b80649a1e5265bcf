"""bench/llm.py's orchestrator: each torch route's worker process (bench/_llm_worker.py), llama.cpp's runs,
the interleaved timed rounds at one thread count, their summary and table. No torch here."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import _llamacpp
import _llm_model
import _processes
from _llm_routes import COMPILED, ROUTES, isa_env, long_prompt
from _llm_worker import REPLY
from _machine_bench import median, paired_ratio

SCRIPT = str(Path(__file__).resolve().parent / "llm.py")     # the workers run bench/llm.py --worker ROUTE


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
            [sys.executable, SCRIPT, "--worker", route, "--model-dir", str(folder), "--prompt", str(args.prompt),
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

    def stop(self, grace: float = 2.0) -> None:
        """End the worker and what it started (inductor's compile workers) now, wherever it is: SIGTERM,
        SIGKILL after ``grace`` s (an interrupted bench; one setting up never reads its stdin's end)."""
        if self.process.returncode is None:          # not reaped yet (close() reaps)
            _processes.stop_tree(self.process, grace)
            self.process.wait()
        self.log.close()


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
    xlaunch routes' packed files, with ``--load packed`` or ``decoder``). Interrupted (Ctrl-C, the bench's
    SIGTERM, an error), it stops every worker it started before it goes on."""
    started: list[Worker] = []
    try:
        return _rounds(threads, args, folder, llama, packed, started)
    except BaseException:
        for worker_ in started:
            worker_.stop()
        raise


def _rounds(threads: int, args: argparse.Namespace, folder: Optional[Path],
            llama: Optional[tuple[Path, dict[str, Path]]], packed: Optional[dict[str, Optional[Path]]],
            started: list[Worker]) -> dict[str, dict[str, Any]]:
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
        started.append(worker_)
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
