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
import math
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
LOCK = ".xlaunch-tune.lock"          # held (flock) by the session writing in the directory
MAX_TRIALS_JSON = 256 << 20        # read back by --resume (a 10,000-trial session: about 30 MB)
PROGRAM_DIGEST = "program_sha256"  # in the signature; a change is a warning on --resume, not a refusal
MAX_PROGRAM = 64 << 20             # a larger PROGRAM is not hashed
_said: set[str] = set()


class ResumeError(ValueError):
    """Earlier results that cannot be continued (or would be overwritten)."""


def signature(tuner_args: dict[str, Any]) -> dict[str, Any]:
    """What must match for ``--resume`` to continue a session (JSON-normalised)."""
    return json.loads(json.dumps(tuner_args))


def program_digest(command: list[str]) -> Optional[str]:
    """sha256 of PROGRAM when it is a regular file here (a script, a binary) of at most 64 MiB."""
    import hashlib

    try:
        return hashlib.sha256(read_user_file(command[0], MAX_PROGRAM)).hexdigest()
    except (OSError, ValueError, IndexError):      # UserFileError is a ValueError
        return None


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
        rounds = f"{again.count} interleaved round{'s' if again.count != 1 else ''}, {again.low:.6g} .. {again.high:.6g}"
        if final is not None and final.winner == best.number:
            lines.append(f"  {objective_label}: {again.median:.6g} re-measured (median of {rounds}); search: {searched}")
        else:                    # interrupted: the re-measurement did not decide, the search did
            lines.append(f"  {objective_label}: {searched}, chosen by the search; its re-measurement against the "
                         f"runner-up did not finish ({again.median:.6g}, median of {rounds})")
    else:
        lines.append(f"  {objective_label}: {searched}")
    separator = "-- " if command and command[0].startswith("-") else ""
    # from where xlaunch-tune ran, as the program's path is: DIR/best.toml as --output-dir named it
    run = f"xlaunch --config {shlex.quote(path)} {separator}{shlex.join(command)}"
    lines.append(f"Run it with:  {tomlfile.comment_text(run)}")       # one line, whatever the arguments hold
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
        if old.get(key) != sig[key] and key != PROGRAM_DIGEST:
            raise ResumeError(f"{path} is from a different session ({key} differs: "
                              f"{json.dumps(old.get(key))} there, {json.dumps(sig[key])} now)")
    if old.get(PROGRAM_DIGEST) not in (None, sig.get(PROGRAM_DIGEST)) and path not in _said:
        _said.add(path)        # the trials are kept: editing a print must not cost the session; said once
        import sys

        sys.stderr.write(f"xlaunch-tune: warning: --resume: {sig['command'][0]} changed since {path} was written "
                         "(its sha256 differs): the earlier trials measured the program as it was\n")
    try:
        trials = [_trial(row, sig.get("space", {})) for row in _list(doc.get("trials", []), "trials")]
        skipped = [Skipped(_point(row["config"], sig.get("space", {})), _text(row["reason"], "reason"))
                   for row in _list(doc.get("skipped", []), "skipped")]
        numbers = [record.number for record in trials]
        if len(set(numbers)) != len(numbers):
            raise ValueError("two trials have the same number")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ResumeError(f"{path} is damaged ({type(exc).__name__}: {exc})") from None
    return trials, skipped


def _trial(row: Any, space: dict[str, list[Any]]) -> TrialRecord:
    """One row of ``trials.json`` read back, every field checked: a hand-edited or damaged row is
    a ValueError or TypeError here, never a traceback later or a best.toml from a point off the space."""
    number = row["number"]
    if type(number) is not int or number < 1:
        raise ValueError(f"trial number {number!r}")
    runs = [_run(run) for run in _list(row.get("runs", []), "runs")]
    instances = tuple(_list(row.get("instances", []), "instances"))
    if not all(type(index) is int and index >= 0 for index in instances):
        raise ValueError(f"trial {number}: instances {list(instances)!r}")
    table = row["launch_config"]
    if not isinstance(table, dict) or not all(isinstance(key, str) for key in table):
        raise TypeError(f"trial {number}: launch_config is not a table")
    tomlfile.dumps(table)                          # values a config file can hold
    warnings = tuple(_text(w, "warning") for w in _list(row.get("warnings", []), "warnings"))
    return TrialRecord(number, _point(row["config"], space), dict(table), instances, runs, warnings)


def _run(run: Any) -> dict[str, Any]:
    if not isinstance(run, dict) or run.get("status") not in ("ok", "failed"):
        raise ValueError(f"a run's status is not 'ok' or 'failed': {run!r}"[:200])
    _text(run.get("reason", ""), "reason")
    for name in ("value", "wall_time"):
        value = run.get(name)
        if not (value is None and name == "value" and run["status"] == "failed") and not _finite(value):
            raise ValueError(f"a run's {name} is {value!r}"[:200])
    if not all(v is None or _finite(v) for v in _list(run.get("instance_values", []), "instance_values")):
        raise ValueError(f"a run's instance_values are {run.get('instance_values')!r}"[:200])
    for cell in _list(run.get("kernels", []), "kernels"):
        _text(cell, "kernels")
    return run


def _point(config: Any, space: dict[str, list[Any]]) -> dict[str, Any]:
    """A point of this session's space (the signature's), or a ValueError."""
    if not isinstance(config, dict) or set(config) != set(space) or \
            any(not any(value == v and type(value) is type(v) for v in space[key]) for key, value in config.items()):
        raise ValueError(f"{json.dumps(config)[:200]} is not a point of the space")
    return {key: config[key] for key in space}


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{what} is not a list")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} {value!r} is not a string"[:200])
    return value


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def check_fresh(directory: str) -> None:
    """Without --resume, refuse to overwrite an earlier session's results."""
    for name in (TRIALS_JSON, STUDY_DB):
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            raise ResumeError(f"{path} exists (add --resume to continue that session, or use another directory)")


def lock(directory: str) -> int:
    """Hold ``DIR/.xlaunch-tune.lock`` for this session (an exclusive ``flock`` on the returned
    descriptor, released when it is closed or the process ends). A second session writing in the
    same directory would remove the first one's run directories under its running trials."""
    import fcntl
    import stat

    path = os.path.join(directory, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ResumeError(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ResumeError(f"{path} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise ResumeError(f"{directory!r} is in use by another xlaunch-tune session"
                              + (f" (pid {holder})" if holder.isdigit() else "")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
