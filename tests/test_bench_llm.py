"""bench/llm.py's own logic, without timing a model: its arguments, its route list (printed without
loading torch), llama-bench's JSON as it parses it, the command lines it runs, and the summary's
ratios to llama.cpp at the same precision."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_modules import BENCH, load, tiny_packed


# llama-bench -o json, one decode test (-p 0 -n 23 -d 33 -r 2), as this build prints it (trimmed of
# the fields the bench does not read).
DECODE_JSON = """[
  {
    "build_commit": "unknown",
    "cpu_info": "AMD EPYC [4th gen]",
    "model_filename": "/cache/q8_0.gguf",
    "model_type": "llama ?B Q8_0",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 23,
    "n_depth": 33,
    "avg_ns": 121000000,
    "avg_ts": 190.25,
    "stddev_ts": 1.5,
    "samples_ns": [ 120000000, 122000000 ],
    "samples_ts": [ 191.5, 189.0 ]
  }
]
"""


def test_list_prints_every_route_without_importing_torch() -> None:
    code = ("import runpy, sys\n"
            f"sys.argv = ['llm.py', '--list']\n"
            "try:\n"
            f"    runpy.run_path({str(BENCH / 'llm.py')!r}, run_name='__main__')\n"
            "except SystemExit as stop:\n"
            "    assert stop.code == 0, stop.code\n"
            "print('heavy:', sorted(m for m in ('torch', 'transformers', 'xlaunch.llm.api', 'xlaunch.llm.loader') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    routes = [line.split()[0] for line in out.splitlines() if line and not line.startswith("heavy:")]
    assert routes == list(load("llm").ROUTES)
    assert {"hf-fp32", "torchao-int8", "xlaunch-int4", "llamacpp-q4_0"} <= set(routes)
    assert out.splitlines()[-1] == "heavy: []"


def test_arguments() -> None:
    llm = load("llm")
    quick = llm.parse_args(["--quick"])
    assert (quick.rounds, quick.new_tokens, quick.threads) == (2, 24, [1, 2])
    assert "hf-bf16-compiled" not in quick.route_names and "llamacpp-q8_0" in quick.route_names
    full = llm.parse_args(["--threads", "2", "--rounds", "3"])
    assert full.route_names == list(llm.ROUTES) and (full.threads, full.rounds, full.new_tokens) == ([2], 3, 48)
    chosen = llm.parse_args(["--routes", "hf-bf16,llamacpp-bf16", "--no-llamacpp", "--lock", ""])
    assert chosen.route_names == ["hf-bf16"] and chosen.lock == "" and chosen.batch == 1
    assert llm.parse_args(["--batch", "4"]).batch == 4
    assert full.load == "checkpoint" and llm.parse_args(["--load", "decoder"]).load == "decoder"


@pytest.mark.parametrize("argv", [["--routes", "hf-bf16,nope"], ["--threads", "0"], ["--threads", "1,x"],
                                  ["--new-tokens", "1"], ["--batch", "0"], ["--batch", "4", "--instances", "2"],
                                  ["--load", "mmap"]])
def test_bad_arguments_stop_with_a_message(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        load("llm").parse_args(argv)
    assert stop.value.code == 2
    assert argv[1].split(",")[-1] in capsys.readouterr().err


def test_isa_caps_both_sides_at_one_level(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """--isa: the torch workers' caps (xlaunch, ATen, oneDNN), llama.cpp's cmake options with nothing above the
    level (AVX-VNNI off at avx2: Zen 3 lacks it), a build folder per level, and a level above this CPU refused."""
    llm, llamacpp = load("llm"), load("_llamacpp")
    from xlaunch import _isa_levels

    assert llm.isa_env(None) == {}
    assert llm.isa_env("avx2") == {"XLAUNCH_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert llm.isa_env("avx512_bf16")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert set(llm.ISA_CAPS) == set(llamacpp.ISA_OPTIONS) <= set(_isa_levels.LEVELS)
    assert llamacpp.cmake_cpu_options(None) == ("-DGGML_NATIVE=ON",)
    avx2 = llamacpp.cmake_cpu_options("avx2")
    assert avx2[0] == "-DGGML_NATIVE=OFF" and {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX_VNNI=OFF",
                                                "-DGGML_AVX512=OFF"} <= set(avx2)
    assert not [option for option in avx2 if "AVX512" in option and option.endswith("=ON")]
    bf16 = llamacpp.cmake_cpu_options("avx512_bf16")
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_INT8=OFF"} <= set(bf16)
    for isa in llamacpp.ISA_OPTIONS:          # each option once: a later -D would silently win
        names = [option.split("=")[0] for option in llamacpp.cmake_cpu_options(isa)]
        assert len(names) == len(set(names)), isa
    with pytest.raises(ValueError, match="amx"):
        llamacpp.cmake_cpu_options("amx")

    monkeypatch.setitem(_isa_levels._host, "levels", ("baseline", "avx2"))     # an AVX2 CPU
    assert llm.parse_args(["--isa", "avx2"]).isa == "avx2"
    with pytest.raises(SystemExit) as stop:
        llm.parse_args(["--isa", "avx512"])
    assert stop.value.code == 2 and "--isa avx512: this CPU cannot execute it; it runs: baseline, avx2" in capsys.readouterr().err


def test_an_isa_build_is_kept_apart_from_the_native_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llamacpp = load("_llamacpp")
    for name in (f"build-{llamacpp.VERSION}-avx2", f"build-{llamacpp.VERSION}-{llamacpp.cpu_key()}"):
        (tmp_path / name / "bin").mkdir(parents=True)
        for target in llamacpp.TARGETS:
            (tmp_path / name / "bin" / target).write_text("")
    assert llamacpp.build(tmp_path, isa="avx2") == tmp_path / f"build-{llamacpp.VERSION}-avx2" / "bin"
    assert llamacpp.build(tmp_path) == tmp_path / f"build-{llamacpp.VERSION}-{llamacpp.cpu_key()}" / "bin"


def test_llama_bench_json() -> None:
    llamacpp = load("_llamacpp")
    (test,) = llamacpp.parse_llama_bench("build: 1 (unknown)\n" + DECODE_JSON)
    assert test == {"kind": "decode", "tokens": 23, "depth": 33, "threads": 2, "type": "llama ?B Q8_0",
                    "avg_ts": 190.25, "samples_ts": [191.5, 189.0]}
    prefill = DECODE_JSON.replace('"n_prompt": 0', '"n_prompt": 32').replace('"n_gen": 23', '"n_gen": 0')
    assert llamacpp.parse_llama_bench(prefill)[0]["kind"] == "prefill"
    with pytest.raises(ValueError, match="separate tests"):        # -pg: prompt and generation in one
        llamacpp.parse_llama_bench(DECODE_JSON.replace('"n_prompt": 0', '"n_prompt": 32'))
    with pytest.raises(ValueError, match="no JSON"):
        llamacpp.parse_llama_bench("error: failed to load model")


def test_llama_bench_command_lines_match_the_torch_measurement() -> None:
    llamacpp = load("_llamacpp")
    decode = llamacpp.llama_bench_argv(Path("/b"), Path("/m.gguf"), 2, "decode", 23, 33, 2)
    assert decode == ["/b/llama-bench", "-m", "/m.gguf", "-t", "2", "-p", "0", "-n", "23", "-d", "33",
                      "-r", "2", "-o", "json"]
    prefill = llamacpp.llama_bench_argv(Path("/b"), Path("/m.gguf"), 1, "prefill", 32, 0, 3)
    assert prefill[5:11] == ["-p", "32", "-n", "0", "-d", "0"]


BATCHED_JSONL = ('{"n_kv_max": 336, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
                 '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 48, "pl": 4, "n_kv": 320, '
                 '"t_pp": 0.512, "speed_pp": 250.0, "t_tg": 2.4, "speed_tg": 80.0, "t": 2.912, "speed": 109.9}')


def test_llama_batched_bench_line_and_command() -> None:
    llamacpp = load("_llamacpp")
    got = llamacpp.parse_batched_bench("main: loading\n" + BATCHED_JSONL + "\n")
    assert got == {"prefill_tps": 250.0, "decode_tps": 80.0, "batch": 4, "prompt": 32, "new_tokens": 48}
    with pytest.raises(ValueError, match="one JSON line"):
        llamacpp.parse_batched_bench("error: failed to load model")
    with pytest.raises(ValueError, match="got 2"):
        llamacpp.parse_batched_bench(BATCHED_JSONL + "\n" + BATCHED_JSONL)
    argv = llamacpp.batched_bench_argv(Path("/b"), Path("/m.gguf"), 2, 32, 48, 4)
    assert argv[0] == "/b/llama-batched-bench" and "-pps" not in argv      # each sequence its own prompt
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert flags["-npp"] == "32" and flags["-ntg"] == "48" and flags["-npl"] == "4" and flags["-t"] == flags["-tb"] == "2"
    assert int(flags["-c"]) >= 4 * (32 + 48) and flags["--output-format"] == "jsonl"


def test_cpu_key_follows_the_flags_not_their_order() -> None:
    key = load("_llamacpp").cpu_key
    base = "model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    assert key(base) == key(base.replace("fpu avx2", "avx2 fpu"))
    assert key(base) != key(base.replace(" avx512_bf16", "")) != key(base.replace("fpu ", ""))


def test_the_sdist_unpacks_only_plain_members_inside_its_folder(tmp_path: Path) -> None:
    """Where Python has no extraction filters (Debian 12's 3.11.2), the llama.cpp sdist's links,
    devices and paths that climb out are left out, and modes lose setuid/world-write."""
    import io
    import tarfile

    llamacpp = load("_llamacpp")
    archive = tmp_path / "sdist.tar.gz"
    with tarfile.open(archive, "w:gz") as bundle:
        def add(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", mode: int = 0o644, link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.linkname, info.size = kind, mode, link, len(data) if kind == tarfile.REGTYPE else 0
            bundle.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        add("pkg", tarfile.DIRTYPE, mode=0o755)
        add("pkg/CMakeLists.txt", mode=0o4777)
        add("pkg/../escaped.txt")
        add("/tmp/absolute.txt")
        add("pkg/link", tarfile.SYMTYPE, link="/etc/passwd")
        add("pkg/hard", tarfile.LNKTYPE, link="pkg/CMakeLists.txt")
        add("pkg/fifo", tarfile.FIFOTYPE)
    with tarfile.open(archive) as bundle:
        kept = [(member.name, member.mode) for member in llamacpp._plain_members(bundle)]
    assert kept == [("pkg", 0o755), ("pkg/CMakeLists.txt", 0o755)]


def test_summary_ratios_pair_rounds_with_the_same_precision() -> None:
    llm = load("llm")
    rows = {
        "hf-bf16": {"status": "ok", "decode_tps": [50.0, 40.0, 60.0], "prefill_tps": [400.0, 300.0, 500.0],
                    "peak_rss_mib": 900.0, "end_rss_mib": 700.0, "first_call_s": 1.0,
                    "dense_rows": {"amx": {"bf16:2048x2048:g0:bfloat16:t16": 128, "bf16:8192x2048:g0:bfloat16:t16": None}}},
        "torchao-int8": {"status": "ok", "decode_tps": [70.0, 70.0, 70.0], "prefill_tps": [100.0] * 3,
                         "peak_rss_mib": 1200.0},
        "xlaunch-int8": {"status": "unavailable: not there"},
        "llamacpp-bf16": {"status": "ok", "decode_tps": [100.0, 80.0, 120.0], "prefill_tps": [800.0, 600.0, 1000.0],
                          "peak_rss_mib": 400.0},
    }
    summary = llm.summarize(rows)
    assert summary["hf-bf16"]["decode_tps"] == 50.0 and summary["hf-bf16"]["decode_vs_llamacpp"] == 0.5
    assert summary["hf-bf16"]["prefill_vs_llamacpp"] == 0.5
    assert summary["torchao-int8"]["decode_vs_llamacpp"] is None      # no Q8_0 row ran
    assert summary["llamacpp-bf16"]["decode_vs_llamacpp"] is None
    assert summary["xlaunch-int8"] == {"status": "unavailable: not there"}
    text = llm.table(2, summary)
    assert "| hf-bf16 | 50.0 | 0.50 | 400 | 0.50 | 900 | 700 | 1.0 |" in text
    assert "| llamacpp-bf16 | 100.0 |  | 800 |  | 400 |  |  |" in text
    assert "| xlaunch-int8 | unavailable: not there |" in text
    assert summary["hf-bf16"]["dense_rows"] == rows["hf-bf16"]["dense_rows"]       # into --json as measured
    assert llm.dense_rows_lines(summary["hf-bf16"]["dense_rows"]) == [
        "ATen's GEMM against the amx kernels: bf16 2048x2048 from 128 rows, bf16 8192x2048 never"]
    assert llm.dense_rows_lines({}) == []
    both = {"amx": {"bf16:2048x2048:g0:bfloat16:t1": None, "bf16:2048x2048:g0:bfloat16:t16": 128}}
    assert llm.dense_rows_lines(llm.own_threads(both, 16)) == [
        "ATen's GEMM against the amx kernels: bf16 2048x2048 from 128 rows"]


def test_a_bad_or_too_big_shape_is_refused_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 4000000 kB\nMemAvailable: 2097152 kB\n")
    env = {**os.environ, "XLAUNCH_FSROOT": str(tmp_path), "XLAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    for argv, expected in ((["--shape", "llama-3.2-1b"], "bench/llm.py: shape llama-3.2-1b needs about "),
                           (["--shape", "llama-3.2-1b"], "this machine has 2.0 GiB available (MemAvailable); nothing"),
                           (["--shape", "llama-9"], "bench/llm.py: --shape: unknown shape 'llama-9' (presets: llama-168m, ")):
        proc = subprocess.run([sys.executable, str(BENCH / "llm.py"), *argv, "--routes", "xlaunch-int4,llamacpp-q4_0",
                               "--lock", ""], capture_output=True, text=True, timeout=60, env=env)
        assert (proc.returncode, proc.stdout, proc.stderr.count("\n")) == (2, "", 1), proc.stderr
        assert expected in proc.stderr and proc.stderr.startswith("bench/llm.py: ")
    assert not (tmp_path / "cache").exists()


def test_need_counts_every_phase_and_the_files_still_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path))
    model_ = load("_llm_model")
    footprint, shapes = model_.footprint, model_.shapes
    tiny = model_.resolve("tiny", None)          # 2 layers, hidden 128, intermediate 256, vocabulary 512, fp32
    assert tiny.preset and not tiny.ready() and tiny.q4_source() == "f32" and tiny.gguf_dir.parent == tmp_path / "llamacpp"
    shape = tiny.shape
    head = 512 * 128
    assert model_.gguf_bytes(shape, "q4_0") == int((shape.parameters() - head) * 18 / 32 + head * 210 / 256)
    need = model_.need(tiny, ["xlaunch-int4"], ["q4_0"], 32, 24)
    # the checkpoint, Q4_0 and the F32 GGUF it is quantized from
    assert need.disk == shapes.checkpoint_bytes(tiny.config) + model_.gguf_bytes(shape, "q4_0") + model_.gguf_bytes(shape, "f32")
    steady, peak = model_.route_bytes("xlaunch-int4", shape, shapes.checkpoint_bytes(tiny.config), 32, 57)
    run = peak + model_.llama_bytes(shape, "q4_0", 32, 57)
    assert need.memory == max(run, footprint.TORCH_PROCESS_BYTES + 3 * shapes.CHUNK_BYTES,
                              model_.CONVERT_BYTES + 12 * 512 * 128)
    # two routes side by side: both steady, plus the larger load peak
    both = model_.need(tiny, ["xlaunch-int4", "hf-bf16"], [], 32, 24)
    steady2, peak2 = model_.route_bytes("hf-bf16", shape, shapes.checkpoint_bytes(tiny.config), 32, 57)
    assert both.memory == steady + steady2 + max(peak - steady, peak2 - steady2)


def test_model_takes_a_checkpoint_folder_and_keeps_its_gguf_out_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    model_ = load("_llm_model")
    folder = tmp_path / "my-model"
    folder.mkdir()
    config = dict(model_.shapes.preset("tiny"), torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [512, 128], "data_offsets": [0, 131072]}})
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(131072))
    mine = model_.resolve(None, str(folder))
    assert (mine.name, mine.preset, mine.ready(), mine.q4_source()) == ("my-model", False, True, "bf16")
    assert mine.gguf_dir.parent == tmp_path / "cache" / "llamacpp"
    assert model_.need(mine, ["xlaunch-bf16"], [], 32, 24).disk == 0         # nothing to write
    (folder / "config.json").write_text("{}")
    with pytest.raises(model_.shapes.ShapeError, match="lacks hidden_size"):
        model_.resolve(None, str(folder))
    with pytest.raises(SystemExit):
        load("llm").parse_args(["--shape", "tiny", "--model", str(folder)])


def test_results_are_written_whole_after_each_part_and_a_failed_write_is_one_line(tmp_path: Path, capsys) -> None:
    """A run stopped by a time limit keeps what it measured: each part is written with complete false,
    the end with true; the file is replaced, never written through a symlink; a write that fails (no
    such folder, full disk) is one line on stderr, not the end of the bench."""
    load("llm")
    common = load("_machine_bench")
    description = {"load_average": [1.0, 1.0, 1.0], "load_average_end": [2.0, 2.0, 2.0]}
    target, elsewhere = tmp_path / "out.json", tmp_path / "elsewhere.json"
    elsewhere.write_text("kept\n")
    target.symlink_to(elsewhere)
    common.write_results(description, str(target), {"results": {"1": "part"}}, final=False)
    assert not target.is_symlink() and elsewhere.read_text() == "kept\n"
    assert json.loads(target.read_text())["complete"] is False and capsys.readouterr().out == ""
    common.write_results(description, str(target), {"results": {"1": "all"}})
    doc = json.loads(target.read_text())
    assert doc["complete"] is True and doc["results"] == {"1": "all"} and doc["machine"] == description
    assert capsys.readouterr().out.splitlines() == ["load average 1.00 at start, 2.00 at the end", f"wrote {target}"]
    common.write_results(description, str(tmp_path / "missing" / "out.json"), {"results": {}})
    out, err = capsys.readouterr()
    assert "wrote" not in out and err.startswith(f"could not write {tmp_path / 'missing' / 'out.json'}: ")
    assert len(err.splitlines()) == 1


def test_a_decoder_workers_rounds_and_memory_come_from_a_process_without_transformers(tmp_path: Path) -> None:
    """``--load decoder``: the worker maps the route's packed file with ``xlaunch.llm.load_decoder``, answers its
    rounds (prefill and t_1/t_N of greedy generate), then its peak RSS, and never imports transformers."""
    checkpoint, packed = tiny_packed(tmp_path, "int8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(BENCH.parent))
    worker = subprocess.run(
        [sys.executable, str(BENCH / "llm.py"), "--worker", "xlaunch-int8", "--model-dir", str(checkpoint),
         "--prompt", "8", "--new-tokens", "4", "--packed", str(packed), "--load", "decoder"],
        input="round\nquit\n", capture_output=True, text=True, env=env, timeout=240)
    assert worker.returncode == 0, worker.stderr[-2000:]
    reply = load("llm").REPLY
    replies = [json.loads(line[len(reply):]) for line in worker.stdout.splitlines() if line.startswith(reply)]
    ready, timed, last = replies
    assert ready["ready"] and timed["genN_s"] > timed["gen1_s"] > 0 and timed["prefill_s"] > 0
    assert last["peak_rss_mib"] > 0 and last["transformers_imported"] is False
