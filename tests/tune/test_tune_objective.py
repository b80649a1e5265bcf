"""Metric parsing (last match per instance), aggregation, medians, objective options."""
from __future__ import annotations

import os

import pytest

from xlaunch.tune.objective import MetricError, aggregate, compile_metric, last_value, make_objective, summarize


def test_last_match_per_instance_counts() -> None:
    pattern = compile_metric(r"throughput: ([0-9.eE+-]+) img/s")
    out = "warming up\nthroughput: 10.5 img/s\nthroughput: 12.25 img/s\nbye\n"
    assert last_value(pattern, out) == 12.25
    assert last_value(pattern, "throughput: 1e3 img/s") == 1000.0
    assert last_value(pattern, "nothing here\n") == "no metric"
    assert last_value(compile_metric(r"value=(\S+)"), "value=fast") == "metric 'fast' is not a number"
    assert last_value(compile_metric(r"value=(\S+)"), "value=nan") == "metric 'nan' is not finite"
    # anchors work per line
    assert last_value(compile_metric(r"^t=(\d+)$"), "t=1\nx t=5\nt=3\n") == 3.0


def test_the_matcher_reads_each_log_s_tail_from_a_whole_line(tmp_path, monkeypatch) -> None:
    """A chatty program's log is not read whole (a 291 MB log took the matcher 580 MB): its last
    TAIL_BYTES, from the first line starting in them; a match only before them is said to be so."""
    from xlaunch.tune import objective

    monkeypatch.setattr(objective, "TAIL_BYTES", 1 << 20)
    pattern = compile_metric(r"^throughput: ([0-9.]+)")
    noise = "noise line\n" * 200_000                     # 2.2 MB
    logs = {"late": "throughput: 1.0\n" + noise + "throughput: 7.5 img/s\nend\n",
            "early": "throughput: 1.0\n" + noise,
            "cut": noise + "xx" + "throughput: 9\n" + "y" * ((1 << 20) - 15) + "\n",   # the tail starts mid-line
            "small": "throughput: 3\n"}
    for name, text in logs.items():
        (tmp_path / name).write_text(text)
    found = objective.metric_values(pattern, [str(tmp_path / name) for name in logs] + [str(tmp_path / "none")], 30)
    assert found == [7.5, "no metric in the last 1 MiB of its output", "no metric in the last 1 MiB of its output",
                     3.0, "no output"]


@pytest.mark.parametrize("regex, problem", [
    (r"throughput: [0-9.]+", "exactly one capture group (the number), found 0"),
    (r"(a)=(\d+)", "exactly one capture group (the number), found 2"),
    (r"(unclosed", "not a valid regular expression"),
])
def test_metric_needs_one_group(regex: str, problem: str) -> None:
    with pytest.raises(MetricError, match=r"^--metric: .*" + problem.replace("(", r"\(").replace(")", r"\)")):
        compile_metric(regex)


def test_aggregates() -> None:
    values = [3.0, 1.0, 2.0, 6.0]
    assert aggregate(values, "sum") == 12.0
    assert aggregate(values, "mean") == 3.0
    assert aggregate(values, "min") == 1.0
    assert aggregate(values, "max") == 6.0
    assert aggregate([0.1] * 10, "sum") == 1.0          # fsum: no drift
    with pytest.raises(ValueError):
        aggregate([], "sum")


def test_summary_is_median_and_range() -> None:
    summary = summarize([10.0, 30.0, 12.0])
    assert (summary.median, summary.low, summary.high, summary.count) == (12.0, 10.0, 30.0, 3)
    assert summary.spread == pytest.approx(20.0 / 12.0)
    assert summarize([4.0, 2.0]).median == 3.0


def test_objective_defaults_and_conflicts() -> None:
    wall = make_objective(None, None, None)
    assert wall.metric is None and wall.goal == "min" and wall.better(1.0, 2.0)
    throughput = make_objective(r"x=(\d+)", None, None)
    assert (throughput.aggregate, throughput.goal) == ("sum", "max") and throughput.better(2.0, 1.0)
    latency = make_objective(r"x=(\d+)", "max", "min")
    assert sorted([3.0, 1.0, 2.0], key=latency.sort_key) == [1.0, 2.0, 3.0]
    for args, message in [((None, None, "max"), "--goal: without --metric"),
                          ((None, "sum", None), "--aggregate: only applies with --metric"),
                          ((r"(\d)", "median", None), "--aggregate: 'median' is not one of"),
                          ((r"(\d)", None, "up"), "--goal: 'up' is not one of")]:
        with pytest.raises(MetricError, match=message):
            make_objective(*args)


def test_values_near_the_largest_float_are_never_a_traceback_or_an_infinite_median() -> None:
    """Two instances' 1e308 summed was OverflowError out of math.fsum (the session died with a
    traceback); the median of two such runs was inf (statistics.median's (a + b) / 2)."""
    import math

    assert aggregate([1e308, 1e308], "sum") == math.inf          # run_once refuses it: a failed run
    assert aggregate([1e308, 1e308], "mean") == 1e308
    assert aggregate([1e308, -1e308], "sum") == 0.0
    assert summarize([1e308, 1.5e308]).median == 1.25e308
    assert summarize([-1e308, -1.7e308, 3.0, 1e308]).median == summarize([3.0, -1e308]).median == -5e307
    assert summarize([1.0, 2.0, 4.0, 8.0]) == summarize([8.0, 4.0, 2.0, 1.0])
    assert summarize([1.0, 2.0, 4.0, 8.0]).median == 3.0 and summarize([5.0, 1.0, 3.0]).median == 3.0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two instances need 2 usable CPUs")
def test_a_sum_past_the_largest_float_fails_that_trial(tmp_path, monkeypatch, capsys) -> None:
    import json

    from xlaunch.tune.cli import run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nninstances = [1, 2]\n")
    (tmp_path / "big.py").write_text("print('score: 1e308')\n")
    code = run(["--space", "space.toml", "--metric", r"score: (\S+)", "--final-rounds", "0", "--no-plot",
                "--output-dir", "out", "big.py"])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "out" / "trials.json").read_text())
    assert [(t["config"]["ninstances"], t["status"], t["reason"]) for t in doc["trials"]] == [
        (1, "ok", ""), (2, "failed", "the sum over instances is not finite (1e+308, 1e+308)")]


COUNTED = """import os, sys
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "count")
n = int(open(path).read()) + 1 if os.path.exists(path) else 1
open(path, "w").write(str(n))
values = sys.argv[1:]
if n > len(values):
    sys.exit(3)
print("score:", values[n - 1])
"""


def _tune_counted(tmp_path, monkeypatch, *values: str) -> tuple[int, str]:
    """Two configurations (``benchmark``, one instance: any CPU count) whose n-th run prints the n-th
    of ``values`` and exits 3 after them, with tune.png."""
    from xlaunch.tune.cli import run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false, true]\n")
    (tmp_path / "counted.py").write_text(COUNTED)
    code = run(["--space", "space.toml", "--metric", r"score: (\S+)", "--final-rounds", "1", "--ninstances", "1",
                "--output-dir", "out", "counted.py", *values])
    return code


def test_values_too_large_to_draw_cost_the_plot_only(tmp_path, monkeypatch, capsys) -> None:
    """-1.7e308 and 1.7e308: the plot's axis overflowed (matplotlib's ValueError ended the session after
    its trials, no table, no exit status); now one warning line, and the rest is written."""
    pytest.importorskip("matplotlib")
    code = _tune_counted(tmp_path, monkeypatch, "-1.7e308", "1.7e308", "1.7e308", "-1.7e308")
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err.splitlines()[1:] == [
        "xlaunch-tune: warning: no tune.png: values from -1.7e+308 to 1.7e+308 are too large to draw (at most 1e+300)"]
    assert "best: #2 benchmark=true" in out and (tmp_path / "out" / "best.toml").exists()
    assert not (tmp_path / "out" / "tune.png").exists()


def test_final_rounds_that_all_failed_plot_without_a_warning(tmp_path, monkeypatch, capsys) -> None:
    """Both finalists failed every final round: no diamond to draw, and no matplotlib warning
    ("No artists with labels found to put in legend") on stderr."""
    import warnings

    pytest.importorskip("matplotlib")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _tune_counted(tmp_path, monkeypatch, "1", "2")
    assert not [str(w.message) for w in caught if "legend" in str(w.message)]
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(err.splitlines()) == 1, err                  # the start line only
    assert "failed 1x: exit 3 (instance 0)" in out
    assert (tmp_path / "out" / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dollar_signs_are_drawn_as_written(tmp_path, monkeypatch, capsys) -> None:
    r"""A ``$`` pair in the command (the plot's title) was matplotlib's math mode: ``$\frac{1}$`` lost
    the plot (and ``$a_b$`` drew a subscript)."""
    from xlaunch.tune.cli import run

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.toml").write_text("[space]\nbenchmark = [false]\n")
    (tmp_path / "prog.py").write_text("print('score: 1')\n")
    code = run(["--space", "space.toml", "--metric", r"score: (\S+)$", "--ninstances", "1", "--output-dir", "out",
                "prog.py", r"$\frac{1}$", "$a_b$"])
    err = capsys.readouterr().err
    assert code == 0 and len(err.splitlines()) == 1, err            # the start line only
    assert (tmp_path / "out" / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
