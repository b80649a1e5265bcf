"""examples/llm.py end to end: alone on a user's checkpoint (--model), and under xlaunch with one instance per CPU and --auto-optimize
applying xlaunch.llm.optimize to the unmodified script's model."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from host_cpus import ALLOWED

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.live]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "llm.py")
SHORT = ["--tiny", "--new-tokens", "4", "--prompt-tokens", "8"]


def rates(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in re.findall(r"^(prefill|decode): ([0-9.]+) tokens/s$", text, re.M)}


def test_the_example_optimizes_a_users_checkpoint_and_reports_both_rates(tmp_path):
    from llm_models import tiny

    tiny("qwen2", seed=4).save_pretrained(tmp_path / "qwen")        # --model: a Hugging Face checkpoint
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, EXAMPLE, *SHORT[1:], "--model", str(tmp_path / "qwen"), "--weights", "int8",
                           "--batch", "2"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""   # the default dtype follows the CPU: no bf16 warning on a CPU without native bf16
    from xlaunch.llm import api

    ran = "bfloat16" if api.native_bf16() else "float32"
    assert f"optimized ({ran}, weights int8) in " in proc.stdout
    assert proc.stdout.splitlines()[0].endswith(f" s: {tmp_path / 'qwen'}")
    found = rates(proc.stdout)
    assert set(found) == {"prefill", "decode"} and min(found.values()) > 0


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

