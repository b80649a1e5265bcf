"""A bench's bad argument is one line naming the option, exit status 2, before anything runs (``--reps 0``
ran every configuration and then ended in statistics' traceback, "no median for empty data"; a
``--models`` typo stopped the bench when it came to that model)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from bench_modules import BENCH, load


@pytest.mark.parametrize("argv, option", [
    (["throughput.py", "--reps", "0"], "--reps"),
    (["throughput.py", "--seconds", "nan"], "--seconds"),
    (["distributed.py", "--timeout", "-1"], "--timeout"),
    (["launch.py", "--reps", "-1"], "--reps"),
    (["kernel_report.py", "--ninstances", "0"], "--ninstances"),
    (["tune.py", "--best", "x", "--reps", "0"], "--reps"),
    (["streams.py", "--variants", "plain,fast"], "--variants"),
    (["streams.py", "--cpus", "0"], "--cpus"),
    (["llm_memory.py", "--share-imports", "torch,no_such_module"], "--share-imports"),
    # matched nothing: ran nothing and exited 0 (distributed.py: "DDP needs at least 2 cores")
    (["throughput.py", "--only", "no-such-shape"], "--only"),
    (["distributed.py", "--only", "no-such-shape"], "--only"),
    (["engines.py", "--startup-budget", "-1"], "--startup-budget"),    # failed after every model's rounds
])
def test_a_bad_count_is_one_line_and_status_2(argv: list[str], option: str) -> None:
    done = subprocess.run([sys.executable, str(BENCH / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{argv[0]}: error: ") and option in last and "Traceback" not in done.stderr, done.stderr


def test_the_argument_types() -> None:
    args = load("_args")
    assert args.COUNT("3") == 3 and args.integer(0)("0") == 0 and args.SECONDS("0.5") == 0.5
    assert args.names(("SGD", "AdamW"))("SGD, AdamW") == ["SGD", "AdamW"]
    assert args.int_range("0-100") == (0, 100) and args.fraction("1") == 1.0
    assert args.modules("json,xml.dom") == "json,xml.dom"
    for check, text in ((args.COUNT, "0"), (args.COUNT, "1.5"), (args.integer(0), "-1"), (args.SECONDS, "0"),
                        (args.SECONDS, "inf"), (args.SECONDS, "x"), (args.names(("SGD", "AdamW")), "Adam"),
                        (args.int_range, "5-1"), (args.int_range, "1"), (args.fraction, "1.5"),
                        (args.modules, "json,"), (args.modules, "json.nothing_here")):
        with pytest.raises(argparse.ArgumentTypeError):
            check(text)
