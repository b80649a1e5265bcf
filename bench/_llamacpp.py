"""llama.cpp as bench/llm.py's peer: its source (the tree vendored in the ``llama-cpp-python`` sdist),
a native build of ``llama-bench``, ``llama-batched-bench`` and ``llama-quantize``, GGUF files converted from the bench's
Hugging Face checkpoint, and ``llama-bench -o json`` runs parsed into tokens/s. No torch here.

Cache layout (``$XLAUNCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/xlaunch``, else ``~/.cache/xlaunch``)::

    llamacpp/src/llama_cpp_python-<version>/vendor/llama.cpp     the source
    llamacpp/build-<version>-<cpu key>/bin/llama-bench            the build (-DGGML_NATIVE=ON)
    llamacpp/build-<version>-<ISA level>/bin/llama-bench          bench/llm.py --isa's build (that level only)
    llamacpp/tokenizer-spm32000-seed0/tokenizer.model             the presets' tokenizer
    llm-shapes/<shape>-seed0-<key>/{config.json,model.safetensors,tokenizer.model}   a preset's checkpoint
    llamacpp/gguf-<model key>/gguf-<version>/{f32,bf16,q8_0,q4_0}.gguf   (never in a user's --model folder)

The CPU key hashes the CPU's flags: a native build only runs where they are. The build's binaries
find their libraries next to them (``$ORIGIN``), so the finished build is renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import _processes  # (bench/ is on sys.path)
from _procmem import MemorySampler

from xlaunch.cpulist import format_cpulist

VERSION = "0.3.36"                       # llama-cpp-python's sdist (it pins one llama.cpp commit)
GGUF_TYPES = ("f32", "bf16", "q8_0", "q4_0")
CONVERT_OUTTYPES = ("f32", "bf16", "q8_0")   # convert_hf_to_gguf.py writes these; q4_0 is llama-quantize's
TARGETS = ("llama-bench", "llama-quantize", "llama-batched-bench")


def cache_root() -> Path:
    base = os.environ.get("XLAUNCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "xlaunch")
    return Path(base) / "llamacpp"


def cpu_key(cpuinfo: Optional[str] = None) -> str:
    """12 hex digits over the CPU's sorted flags (what a -march=native build may use)."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text(errors="replace")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return hashlib.sha256(" ".join(sorted(set(flags))).encode()).hexdigest()[:12]


def _run_logged(argv: Sequence[str], log: Path, what: str, env: Optional[dict] = None,
                progress: Optional[re.Pattern] = None) -> None:
    """Run ``argv`` with its output into ``log``; a progress line every 10 s (or per ninja tenth)."""
    print(f"  {what} (log: {log})", flush=True)
    start = time.monotonic()
    with open(log, "a") as sink:
        process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   start_new_session=True)
        try:
            _follow(process, sink, start, progress)
        except BaseException:          # Ctrl-C, the bench's SIGTERM: the build (make, compilers) stops too
            _processes.stop_tree(process, grace=5.0)
            raise
        code = process.wait()
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{what} failed ({code}); the end of {log}:\n" + "\n".join(tail))
    print(f"    done in {time.monotonic() - start:.0f} s", flush=True)


def _follow(process: subprocess.Popen, sink: Any, start: float, progress: Optional[re.Pattern]) -> None:
    """Copy ``process``'s output into ``sink`` until it ends, printing its progress."""
    last, last_tenth = start, -1
    assert process.stdout is not None
    for line in process.stdout:
        sink.write(line)
        now = time.monotonic()
        match = progress.search(line) if progress else None
        if match:
            tenth = int(match.group(1)) * 10 // max(1, int(match.group(2)))
            if tenth != last_tenth:
                last_tenth = tenth
                print(f"    [{match.group(1)}/{match.group(2)}] {now - start:.0f} s", flush=True)
        elif now - last > 10:
            last = now
            print(f"    ... {now - start:.0f} s", flush=True)


def source_dir(root: Optional[Path] = None) -> Path:
    """The llama.cpp tree; downloaded with ``pip download --no-binary`` and unpacked on first use."""
    root = root or cache_root()
    tree = root / "src" / f"llama_cpp_python-{VERSION}"
    vendored = tree / "vendor" / "llama.cpp"
    if (vendored / "CMakeLists.txt").exists():
        return vendored
    (root / "src").mkdir(parents=True, exist_ok=True)
    archive = root / "src" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.exists():
        with tempfile.TemporaryDirectory(dir=root / "src") as scratch:
            _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
                         f"llama-cpp-python=={VERSION}", "-d", scratch], root / "src" / "download.log",
                        f"downloading the llama-cpp-python {VERSION} sdist (about 75 MB, 1-2 min)")
            shutil.move(str(next(Path(scratch).glob("*.tar.gz"))), archive)
    print(f"  unpacking {archive.name}", flush=True)
    with tarfile.open(archive) as bundle:
        if hasattr(tarfile, "data_filter"):
            bundle.extractall(root / "src", filter="data")
        else:   # Python before 3.11.4 (Debian 12's 3.11.2): no extraction filters
            bundle.extractall(root / "src", members=_plain_members(bundle))
    return vendored


def _plain_members(bundle: tarfile.TarFile) -> Any:
    """The archive's regular files and folders with relative paths inside it; links, devices and
    paths that climb out (``..``, absolute) are left out, as the ``data`` filter would refuse them."""
    for member in bundle:
        parts = Path(member.name).parts
        if (member.isfile() or member.isdir()) and parts and not Path(member.name).is_absolute() and ".." not in parts:
            member.mode &= 0o755
            yield member


# ggml's CPU options for a build capped at one of xlaunch's ISA levels (bench/llm.py --isa): what each level's
# ``-march`` may emit (xlaunch/_isa_levels.py), nothing above it: AVX-VNNI (Zen 4/5, Alder Lake) stays off at
# ``avx2``, since x86-64-v3 CPUs such as Zen 3 and Haswell lack it.
_X86_64_V3 = ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2")
_ABOVE = ("AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")
_LEVEL_ON = {"avx2": (), "avx512": ("AVX512",), "avx512_vnni": ("AVX512", "AVX512_VNNI"),
             "avx512_bf16": ("AVX512", "AVX512_VNNI", "AVX512_BF16")}
ISA_OPTIONS = {level: tuple(f"-DGGML_{name}={'ON' if name in _X86_64_V3 + on else 'OFF'}" for name in _X86_64_V3 + _ABOVE)
               for level, on in _LEVEL_ON.items()}


def cmake_cpu_options(isa: Optional[str]) -> tuple[str, ...]:
    """``-DGGML_NATIVE=ON`` for this CPU (``isa`` None), else ggml's options for that level, native off."""
    if isa is None:
        return ("-DGGML_NATIVE=ON",)
    if isa not in ISA_OPTIONS:
        raise ValueError(f"no llama.cpp build options for the ISA level {isa!r} (known: {', '.join(ISA_OPTIONS)})")
    return ("-DGGML_NATIVE=OFF", *ISA_OPTIONS[isa])


def build(root: Optional[Path] = None, isa: Optional[str] = None) -> Path:
    """The folder holding ``llama-bench``, ``llama-batched-bench`` and ``llama-quantize``, built once per version and CPU
    (cmake + ninja, ``-DGGML_NATIVE=ON``, under ``nice -n 10``: about 4 min on 2 cores); with ``isa`` (an xlaunch
    level, :data:`ISA_OPTIONS`), once per version and level, for any CPU that runs the level."""
    root = root or cache_root()
    final = root / f"build-{VERSION}-{cpu_key() if isa is None else isa}"
    if all((final / "bin" / target).exists() for target in TARGETS):
        return final / "bin"
    source = source_dir(root)
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not on PATH (pip install cmake ninja, or the OS packages)")
    staging = final.with_name(final.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    log = staging / "build.log"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    _run_logged([*nice, "cmake", "-S", str(source), "-B", str(staging), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 *cmake_cpu_options(isa), "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                log, "configuring llama.cpp (cmake)")
    jobs = str(max(1, len(os.sched_getaffinity(0))))
    _run_logged([*nice, "cmake", "--build", str(staging), "--target", *TARGETS, "-j", jobs], log,
                f"building {' and '.join(TARGETS)} with {jobs} jobs (about 4 min on 2 cores)",
                progress=re.compile(r"^\[(\d+)/(\d+)\]"))
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    return final / "bin"


def gguf_file(model_dir: Path, kind: str, bin_dir: Path, source: Path, out_dir: Optional[Path] = None,
              q4_from: str = "f32") -> Path:
    """``model_dir``'s weights as a GGUF of ``kind`` under ``out_dir`` (default ``model_dir``), converted once;
    Q4_0 quantized from the GGUF of ``q4_from`` (F32, or BF16 for a bf16 checkpoint: the same values)."""
    folder = (out_dir or model_dir) / f"gguf-{VERSION}"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{kind}.gguf"
    if target.exists():
        return target
    partial = folder / f"{kind}.gguf.partial"
    log = folder / "convert.log"
    if kind in CONVERT_OUTTYPES:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
        _run_logged([sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", kind,
                     "--outfile", str(partial)], log, f"converting to GGUF {kind.upper()}", env=env)
    elif kind == "q4_0":
        if q4_from not in ("f32", "bf16"):
            raise ValueError(f"Q4_0 is quantized from f32 or bf16, not {q4_from!r}")
        original = gguf_file(model_dir, q4_from, bin_dir, source, out_dir)
        _run_logged([str(bin_dir / "llama-quantize"), str(original), str(partial), "Q4_0"], log,
                    f"quantizing GGUF {q4_from.upper()} to Q4_0 (llama-quantize)")
    else:
        raise ValueError(f"unknown GGUF type {kind!r}")
    partial.rename(target)
    return target


@dataclass
class BenchResult:
    """One llama-bench test: tokens/s per repetition, and the process's peak RSS."""

    tokens_per_s: list[float]
    peak_rss_mib: float
    threads: int


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """``llama-bench -o json``'s tests as ``{"kind": "prefill"|"decode", "tokens", "depth",
    "threads", "type", "avg_ts", "samples_ts"}`` (a test has either prompt or generated tokens)."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench's output")
    tests = json.loads(text[start:text.rfind("]") + 1])
    parsed = []
    for test in tests:
        prompt, generated = int(test.get("n_prompt", 0)), int(test.get("n_gen", 0))
        if (prompt > 0) == (generated > 0):
            raise ValueError(f"a llama-bench test with n_prompt={prompt} and n_gen={generated}: "
                             "run prefill and decode as separate tests")
        parsed.append({
            "kind": "prefill" if prompt else "decode",
            "tokens": prompt or generated,
            "depth": int(test.get("n_depth", 0)),
            "threads": int(test["n_threads"]),
            "type": str(test.get("model_type", "")),
            "avg_ts": float(test["avg_ts"]),
            "samples_ts": [float(value) for value in test.get("samples_ts", [test["avg_ts"]])],
        })
    return parsed


def llama_bench_argv(bin_dir: Path, gguf: Path, threads: int, kind: str, tokens: int, depth: int,
                     repetitions: int) -> list[str]:
    """One test: prefill of ``tokens`` prompt tokens, or decode of ``tokens`` after ``depth`` in context."""
    counts = ["-p", str(tokens), "-n", "0"] if kind == "prefill" else ["-p", "0", "-n", str(tokens)]
    return [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), *counts, "-d", str(depth),
            "-r", str(repetitions), "-o", "json"]


def batched_bench_argv(bin_dir: Path, gguf: Path, threads: int, prompt: int, new_tokens: int, batch: int) -> list[str]:
    """``llama-batched-bench``: ``batch`` sequences of ``prompt`` tokens each (not shared) prefilled together,
    then ``new_tokens`` steps of ``batch`` tokens; one JSON line."""
    context = batch * (prompt + new_tokens) + 16
    return [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
            "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new_tokens),
            "-npl", str(batch), "--output-format", "jsonl"]


def parse_batched_bench(text: str) -> dict[str, Any]:
    """The one result line of ``llama-batched-bench --output-format jsonl``: aggregate prefill and decode
    tokens/s (``speed_pp``: batch x prompt / t_pp; ``speed_tg``: batch x new tokens / t_tg)."""
    lines = [line for line in text.splitlines() if line.lstrip().startswith("{")]
    if len(lines) != 1:
        raise ValueError(f"expected one JSON line from llama-batched-bench, got {len(lines)}")
    row = json.loads(lines[0])
    return {"prefill_tps": float(row["speed_pp"]), "decode_tps": float(row["speed_tg"]), "batch": int(row["pl"]),
            "prompt": int(row["pp"]), "new_tokens": int(row["tg"])}


def run_measured(argv: Sequence[str], what: str) -> tuple[str, float]:
    """Run a llama.cpp tool to the end: its stdout and its peak RSS in MiB (wait4); a failure raises."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(list(argv), stdout=out, stderr=err)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:          # Ctrl-C, the bench's SIGTERM: llama.cpp's tool stops too
            process.kill()
            process.wait()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            raise RuntimeError(f"{what} failed ({process.returncode}): {err.read().decode(errors='replace')[-800:]}")
        return out.read().decode(), usage.ru_maxrss / 1024


def run_llama_bench(argv: Sequence[str]) -> tuple[dict[str, Any], float]:
    """Run one llama-bench test; its parsed result and the process's peak RSS in MiB (wait4)."""
    text, peak = run_measured(argv, "llama-bench")
    tests = parse_llama_bench(text)
    if len(tests) != 1:
        raise ValueError(f"expected one llama-bench test, got {len(tests)}")
    return tests[0], peak


SAMPLE_S = 0.2            # the slots' memory, sampled as bench/_llm_instances.py samples its copies


# -- bench/llm.py --instances: k llama-bench processes -------------------------------------------------------------
def run_slots(argv: Sequence[str], cpus: list[list[int]], rounds: int,
              parse: Callable[[str], list[dict[str, Any]]]) -> dict[str, Any]:
    """k ``taskset -c CPUS llama-bench ...`` slots, each restarting its run until every slot has ``rounds``
    runs that started after the common start; then the running ones are stopped (not counted)."""
    slots: list[dict[str, Any]] = [{"cpus": one, "done": [], "proc": None} for one in cpus]

    def launch(slot: dict[str, Any]) -> None:
        out = tempfile.TemporaryFile()
        slot["out"], slot["began"] = out, time.monotonic()
        slot["proc"] = subprocess.Popen(["taskset", "-c", format_cpulist(slot["cpus"]), *argv], stdout=out,
                                        stderr=subprocess.DEVNULL)

    start = time.monotonic()
    try:
        return _llama_window(slots, launch, start, rounds, parse, cpus)
    finally:                # the running ones (or all, when interrupted) are stopped
        for slot in slots:
            if slot["proc"] is not None and slot["proc"].poll() is None:
                slot["proc"].terminate()
                slot["proc"].wait()
                slot["out"].close()


def _llama_window(slots: list[dict[str, Any]], launch: Callable[[dict[str, Any]], None], start: float, rounds: int,
                  parse: Callable[[str], list[dict[str, Any]]], cpus: list[list[int]]) -> dict[str, Any]:
    for slot in slots:
        launch(slot)
    sampler = MemorySampler([])
    failure = None
    next_sample = start + SAMPLE_S
    while failure is None and any(len(slot["done"]) < rounds for slot in slots):
        time.sleep(0.02)
        for slot in slots:
            code = slot["proc"].poll()
            if code is None:
                continue
            slot["out"].seek(0)
            text = slot["out"].read().decode(errors="replace")
            slot["out"].close()
            if code != 0:
                failure = f"failed: taskset/llama-bench exited {code}"
                break
            try:
                (test,) = parse(text)
            except ValueError as error:
                failure = f"failed: {error}"
                break
            slot["done"].append(test["avg_ts"])
            launch(slot)
        if time.monotonic() >= next_sample and failure is None:
            sampler.pids = [slot["proc"].pid for slot in slots]
            sampler.sample()
            next_sample = time.monotonic() + SAMPLE_S
    window = time.monotonic() - start
    if failure:
        return {"status": failure}
    return {"status": "ok", "cpus": cpus, "decode_rounds": [slot["done"] for slot in slots], "window_s": window,
            **sampler.result()}
