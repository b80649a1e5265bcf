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
import json
import os
import time
from typing import Any, Optional

from xlaunch.tune import tomlfile
from xlaunch.tune.candidate import Skipped
from xlaunch.tune.session import Outcome, TrialRecord, Tuner
from xlaunch.tune.space import describe

FORMAT_VERSION = 1
TRIALS_JSON = "trials.json"
TRIALS_CSV = "trials.csv"
BEST_TOML = "best.toml"
STUDY_DB = "study.db"


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
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
        handle.write("\n")
    os.replace(temporary, path)
    return path


def save_csv(directory: str, tuner: Tuner) -> str:
    path = os.path.join(directory, TRIALS_CSV)
    keys = list(tuner.space.keys)
    header = ["number", *keys, "status", "reason", "value", "low", "high", "repeats", "wall_time",
              "instance_values", "kernels"]
    with open(path, "w", encoding="utf-8", newline="") as handle:
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
    return path


def _num(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.6g}"


def save_best(directory: str, best: TrialRecord, command: list[str], objective_label: str) -> str:
    path = os.path.join(directory, BEST_TOML)
    import shlex

    summary = best.summary
    measured = f"{summary.median:.6g} (median of {summary.count}, {summary.low:.6g} .. {summary.high:.6g})" if summary else "-"
    header = (
        f"Best launch configuration found by xlaunch-tune ({time.strftime('%Y-%m-%d %H:%M')}):\n"
        f"  {describe(best.point)}\n"
        f"  {objective_label}: {measured}\n"
        f"Run it with:  xlaunch --config {BEST_TOML} {shlex.join(command)}"
    )
    tomlfile.write(path, best.table, header)
    return path


def load(directory: str, sig: dict[str, Any]) -> tuple[list[TrialRecord], list[Skipped]]:
    """Earlier trials and skipped points of a session with the same signature."""
    path = os.path.join(directory, TRIALS_JSON)
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        return [], []
    except (OSError, ValueError) as exc:
        raise ResumeError(f"cannot read {path}: {exc}") from None
    if doc.get("xlaunch_tune") != FORMAT_VERSION:
        raise ResumeError(f"{path} was not written by this version of xlaunch-tune")
    old = doc.get("signature", {})
    for key in sig:
        if old.get(key) != sig[key]:
            raise ResumeError(f"{path} is from a different session ({key} differs: "
                              f"{json.dumps(old.get(key))} there, {json.dumps(sig[key])} now)")
    trials = [TrialRecord.from_json(row) for row in doc.get("trials", [])]
    skipped = [Skipped(dict(row["config"]), row["reason"]) for row in doc.get("skipped", [])]
    return trials, skipped


def check_fresh(directory: str) -> None:
    """Without --resume, refuse to overwrite an earlier session's results."""
    for name in (TRIALS_JSON, STUDY_DB):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            raise ResumeError(f"{path} exists (add --resume to continue that session, or use another directory)")
