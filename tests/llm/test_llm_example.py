"""examples/llm.py end to end: on a user's checkpoint (--model; its main() in this process), and under xlaunch
with one instance per CPU and --auto-optimize applying xlaunch.llm.optimize to the unmodified script's model."""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from host_cpus import ALLOWED
from native_kernels import without_unbuilt_kernels_messages

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.live]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "llm.py")
SHORT = ["--tiny", "--new-tokens", "4", "--prompt-tokens", "8"]


def rates(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in re.findall(r"^(prefill|decode): ([0-9.]+) tokens/s$", text, re.M)}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.name}: {record.getMessage()}")


def run_in_this_process(argv: list[str], capfd) -> tuple[str, list[str]]:
    """examples/llm.py's main(argv) here (torch and transformers are imported already: a fresh process would
    spend ~11 s of CPU on imports): its stdout, and what it would have printed to stderr besides, as a program:
    warnings that Python's default filters show and log records of WARNING and up (transformers' loggers do
    not propagate: they get the handler too). The run under xlaunch below checks a fresh process's stderr."""
    spec = importlib.util.spec_from_file_location("xlaunch_llm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loggers = [logging.getLogger(name) for name in ("", "transformers", "torch", "torchao", "xlaunch")]
    records = Records()
    for logger in loggers:
        logger.addHandler(records)
    capfd.readouterr()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert example.main(argv) == 0
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    out, err = capfd.readouterr()
    assert err == "", err[-3000:]
    quiet = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)  # ignored by default
    return out, [f"{Path(w.filename).name}: {w.message}" for w in caught if not issubclass(w.category, quiet)] + records.seen


def test_the_example_optimizes_a_users_checkpoint_and_reports_both_rates(tmp_path, capfd, one_torch_thread):
    from llm_models import tiny

    tiny("qwen2", seed=4).save_pretrained(tmp_path / "qwen")        # --model: a Hugging Face checkpoint
    out, warned = run_in_this_process([*SHORT[1:], "--model", str(tmp_path / "qwen"), "--weights", "int8",
                                       "--batch", "2"], capfd)
    # the default dtype follows the CPU: no bf16 warning on a CPU without native bf16
    assert without_unbuilt_kernels_messages(warned) == []
    from xlaunch.llm import api

    ran = "bfloat16" if api.native_bf16() else "float32"
    assert f"optimized ({ran}, weights int8) in " in out
    assert out.splitlines()[0].endswith(f" s: {tmp_path / 'qwen'}")
    assert " threads 1 batch 2" in out
    found = rates(out)
    assert set(found) == {"prefill", "decode"} and min(found.values()) > 0


def test_bf16_asked_of_a_cpu_without_native_bf16_is_one_warning_at_the_callers_line(tmp_path, capfd, monkeypatch,
                                                                                   one_torch_thread):
    from llm_models import tiny

    from xlaunch.llm import api

    tiny("llama", seed=5).save_pretrained(tmp_path / "llama")
    monkeypatch.setattr(api, "native_bf16", lambda: False)
    out, warned = run_in_this_process([*SHORT[1:], "--model", str(tmp_path / "llama"), "--dtype", "bfloat16"], capfd)
    assert len(warned) == 1 and warned[0].startswith("llm.py: xlaunch.llm.from_pretrained: neither AVX512_BF16 nor AMX_BF16"), warned
    assert "optimized (bfloat16, weights none) in " in out


def test_xlaunch_runs_one_copy_per_cpu_and_auto_optimize_packs_the_decoder(tmp_path):
    instances = 2 if len(ALLOWED) >= 2 else 1
    summary = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "xlaunch", "--ninstances", str(instances), "--ncores-per-instance", "1",
                           "--auto-optimize", "--auto-optimize-verbose", "--summary-json", str(summary),
                           EXAMPLE, *SHORT, "--no-optimize", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seen = re.findall(r"^\[\d+\] instance (\d+) cpus ([0-9,]+) threads 1 ", proc.stdout, re.M)
    assert sorted(index for index, _ in seen) == [str(i) for i in range(instances)], proc.stdout
    assert len({cpus for _, cpus in seen}) == instances and all("," not in c for _, c in seen)
    assert proc.stdout.count("decode: ") == instances
    assert proc.stdout.count("LlamaForCausalLM optimized in place by xlaunch.llm float32") == instances
    assert "xlaunch.llm float32" in summary.read_text()



def test_instances_decode_one_packed_file_written_once_without_transformers(tmp_path):
    """--packed under xlaunch: the first instance to take the lock writes the missing file (a child process),
    the others find it fresh; every instance maps it with load_decoder and never imports transformers."""
    instances = 2 if len(ALLOWED) >= 2 else 1
    packed = tmp_path / "tiny-int8.xlp"
    proc = subprocess.run([sys.executable, "-m", "xlaunch", "--ninstances", str(instances), "--ncores-per-instance", "1",
                           EXAMPLE, *SHORT, "--weights", "int8", "--packed", str(packed)],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("packed file written (missing) in ") == 1, proc.stdout
    assert proc.stdout.count("weights int8) mapped in ") == instances
    assert proc.stdout.count("; transformers not imported") == instances
    assert proc.stdout.count("decode: ") == instances
    assert [line for line in proc.stderr.splitlines() if not line.startswith("xlaunch: ")] == []


def test_a_link_planted_at_the_packed_files_lock_is_one_line_and_exit_2(tmp_path, capfd):
    spec = importlib.util.spec_from_file_location("xlaunch_llm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    (tmp_path / "m.xlp.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SystemExit) as stop:
        example.main([*SHORT, "--packed", str(tmp_path / "m.xlp")])
    assert stop.value.code == 2 and not (tmp_path / "elsewhere").exists() and not (tmp_path / "m.xlp").exists()
    err = capfd.readouterr().err.strip()
    assert err.startswith("examples/llm.py: --packed: cannot open the lock ") and "\n" not in err


@pytest.mark.parametrize("what", ["fifo", "directory", "user file", "link"])
def test_packed_never_replaces_what_is_not_a_packed_file(what, tmp_path, capfd):
    """--packed at a FIFO, a directory (its lock was made beside it), someone's own file or a link is one line and
    exit 2, the thing left as it was: the example renamed a packed file over it (as root, over /dev/null)."""
    spec = importlib.util.spec_from_file_location("xlaunch_llm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    target = tmp_path / "target"
    mine = tmp_path / "mine.py"
    mine.write_text("print('mine')\n")
    if what == "fifo":
        os.mkfifo(target)
    elif what == "directory":
        target.mkdir()
    elif what == "user file":
        target = mine
    else:
        target.symlink_to(mine)
    with pytest.raises(SystemExit) as stop:
        example.main([*SHORT, "--packed", str(target)])
    err = capfd.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith(f"examples/llm.py: --packed: {target} ") and "\n" not in err, err
    assert mine.read_text() == "print('mine')\n"
    assert (target.is_fifo() if what == "fifo" else target.is_dir() if what == "directory" else
            target.is_symlink() if what == "link" else target.is_file())
    assert what not in ("fifo", "directory") or not (tmp_path / "target.lock").exists()   # refused before the lock


@pytest.mark.parametrize("route", [[], ["--no-optimize"], ["--packed"]])
def test_a_model_folder_without_weights_is_one_line_and_exit_2(route, tmp_path, capfd, one_torch_thread):
    """A checkpoint folder whose config.json reads but which holds no weights ended in a traceback, exit 1
    (from_pretrained's ValueError, transformers' OSError; --packed: the writing child's traceback, then a line)."""
    from llm_models import tiny

    spec = importlib.util.spec_from_file_location("xlaunch_llm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tiny("llama", seed=5).config.save_pretrained(tmp_path / "bare")        # config.json, no weights
    route = [*route, str(tmp_path / "m.xlp")] if route == ["--packed"] else route
    capfd.readouterr()
    try:
        code = example.main([*SHORT[1:], "--model", str(tmp_path / "bare"), *route])
    except SystemExit as stop:
        code = stop.code
    err = capfd.readouterr().err.strip()
    assert code == 2 and err.startswith("examples/llm.py: --model: ") and "\n" not in err, err
    assert not (tmp_path / "m.xlp").exists()


def test_weights_with_no_optimize_is_refused_in_one_line(capfd):
    """--no-optimize --weights int8 ran plain Hugging Face in bf16/fp32 and printed its rates, the int8 asked for
    silently dropped."""
    spec = importlib.util.spec_from_file_location("xlaunch_llm_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit) as stop:
        example.main([*SHORT, "--no-optimize", "--weights", "int8"])
    err = capfd.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err[-1].endswith(": error: --weights int8 needs xlaunch.llm; --no-optimize runs "
                                                     "the model's weights in --dtype")
