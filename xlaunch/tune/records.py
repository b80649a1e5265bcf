"""What a tuning session leaves in ``--output-dir``, and reading it back for ``--resume``.

* ``trials.json`` -- the session's signature (space, program, fixed options, objective), one
  row per trial (every option value, per-instance metric values of every run, aggregate,
  status and reason, wall time), the skipped points with reasons, the final re-measurement
  and the best trial. Rewritten after every trial, so an interrupted session can resume.
* ``trials.csv`` -- the same rows, flat, for spreadsheets.
* ``best.toml`` -- the winner as a launcher config file: ``xlaunch --config best.toml PROGRAM``.
"""
from __future__ import annotations

import csv
import io
import json
import os
import time
from typing import Any, Optional

from xlaunch.tune import tomlfile
from xlaunch.tune.candidate import Skipped
from xlaunch.tune.objective import summarize
from xlaunch.tune.session import Final, Outcome, TrialRecord, Tuner
from xlaunch.tune.space import describe
from xlaunch.userfiles import UserFileError, read_user_file, write_atomically

FORMAT_VERSION = 1
TRIALS_JSON = "trials.json"
TRIALS_CSV = "trials.csv"
BEST_TOML = "best.toml"
STUDY_DB = "study.db"
MAX_TRIALS_JSON = 256 << 20        # read back by --resume (a 10,000-trial session: about 30 MB)


class ResumeError(ValueError):
    """Earlier results that cannot be continued (or would be overwritten)."""


def signature(tuner_args: dict[str, Any]) -> dict[str, Any]:
    """What must match for ``--resume`` to continue a session (JSON-normalised)."""
    return json.loads(json.dumps(tuner_args))


def document(tuner: Tuner, sig: dict[str, Any], outcome: Optional[Outcome] = None) -> dict[str, Any]:
    best = outcome.best if outcome is not None else None
    return {
        "xlaunch_tune": FORMAT_VERSION,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "signature": sig,
        "objective": {"label": tuner.objective.label, "goal": tuner.objective.goal},
        "trials": [record.to_json() for record in tuner.records],
        "skipped": [{"config": dict(s.point), "reason": s.reason} for s in tuner.skipped],
        "final": tuner.final.to_json() if tuner.final is not None else None,
        "best": best.number if best is not None else None,
        "interrupted": bool(outcome and outcome.interrupted),
    }


def save_json(directory: str, doc: dict[str, Any]) -> str:
    path = os.path.join(directory, TRIALS_JSON)
    return write_atomically(path, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))


def save_csv(directory: str, tuner: Tuner) -> str:
    path = os.path.join(directory, TRIALS_CSV)
    keys = list(tuner.space.keys)
    header = ["number", *keys, "status", "reason", "value", "low", "high", "repeats", "wall_time",
              "instance_values", "kernels"]
    with io.StringIO(newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for record in tuner.records:
            row = record.to_json()
            per_run = " | ".join(
                " ".join("-" if v is None else f"{v:g}" for v in run["instance_values"]) for run in record.runs
            )
            writer.writerow([row["number"], *(row["config"].get(k) for k in keys), row["status"], row["reason"],
                             _num(row["value"]), _num(row["low"]), _num(row["high"]), row["repeats"],
                             _num(row["wall_time"]), per_run, record.kernels])
        for skip in tuner.skipped:
            writer.writerow(["", *(skip.point.get(k) for k in keys), "skipped", skip.reason, "", "", "", 0, "", "", ""])
        return write_atomically(path, handle.getvalue().encode("utf-8"))


def _num(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.6g}"


def save_best(directory: str, best: TrialRecord, command: list[str], objective_label: str,
              final: Optional[Final] = None) -> str:
    """``best.toml``; its comment gives the value that decided: the interleaved re-measurement
    when there was one (``final``), and the search's median."""
    path = os.path.join(directory, BEST_TOML)
    import shlex

    summary = best.summary
    searched = f"{summary.median:.6g} (median of {summary.count}, {summary.low:.6g} .. {summary.high:.6g})" if summary else "-"
    values = final.values.get(best.number, []) if final is not None else []
    lines = [f"Best launch configuration found by xlaunch-tune ({time.strftime('%Y-%m-%d %H:%M')}):",
             f"  {describe(best.point)}"]
    if values:
        again = summarize(values)
        lines.append(f"  {objective_label}: {again.median:.6g} re-measured (median of {again.count} interleaved "
                     f"round{'s' if again.count != 1 else ''}, {again.low:.6g} .. {again.high:.6g}); search: {searched}")
    else:
        lines.append(f"  {objective_label}: {searched}")
    separator = "-- " if command and command[0].startswith("-") else ""
    lines.append(f"Run it with:  xlaunch --config {BEST_TOML} {separator}{shlex.join(command)}")
    tomlfile.write(path, best.table, "\n".join(lines))
    return path


def load(directory: str, sig: dict[str, Any]) -> tuple[list[TrialRecord], list[Skipped]]:
    """Earlier trials and skipped points of a session with the same signature."""
    path = os.path.join(directory, TRIALS_JSON)
    if not os.path.lexists(path):
        return [], []
    try:
        doc = json.loads(read_user_file(path, MAX_TRIALS_JSON))
    except UserFileError as exc:
        raise ResumeError(str(exc)) from None
    except ValueError as exc:
        raise ResumeError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ResumeError(f"{path} was not written by xlaunch-tune")
    if doc.get("xlaunch_tune") != FORMAT_VERSION:
        raise ResumeError(f"{path} was not written by this version of xlaunch-tune")
    old = doc.get("signature", {})
    for key in sig:
        if old.get(key) != sig[key]:
            raise ResumeError(f"{path} is from a different session ({key} differs: "
                              f"{json.dumps(old.get(key))} there, {json.dumps(sig[key])} now)")
    try:
        trials = [TrialRecord.from_json(row) for row in doc.get("trials", [])]
        skipped = [Skipped(dict(row["config"]), row["reason"]) for row in doc.get("skipped", [])]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ResumeError(f"{path} is damaged ({type(exc).__name__}: {exc})") from None
    return trials, skipped


def check_fresh(directory: str) -> None:
    """Without --resume, refuse to overwrite an earlier session's results."""
    for name in (TRIALS_JSON, STUDY_DB):
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            raise ResumeError(f"{path} exists (add --resume to continue that session, or use another directory)")
