"""``xlaunch-tune``: find the fastest launch configuration for the user's own program.

Every candidate configuration runs the program through the launcher itself (its config files,
its option validation, its planner and runner), so what is measured is exactly what
``xlaunch --config best.toml PROGRAM`` later runs. Rooms:

* :mod:`~xlaunch.tune.space`      -- the ``[space]`` TOML table, the default space, points
* :mod:`~xlaunch.tune.tomlfile`   -- writing the flat launcher config files (trial.toml, best.toml)
* :mod:`~xlaunch.tune.candidate`  -- a point checked by the launcher's own ``--dry-run``
* :mod:`~xlaunch.tune.objective`  -- metric regex, per-instance values, aggregation, medians
* :mod:`~xlaunch.tune.trial`      -- one launch as a child process with a timeout
* :mod:`~xlaunch.tune.strategies` -- grid, random, tpe (Optuna, imported only when asked)
* :mod:`~xlaunch.tune.session`    -- the loop: strategy, repeats, failures, final re-measurement
* :mod:`~xlaunch.tune.records`    -- trials.json, trials.csv, best.toml; resume
* :mod:`~xlaunch.tune.report` (the table, the progress bar), :mod:`~xlaunch.tune.plot` -- output
* :mod:`~xlaunch.tune.cli`        -- the command line
* :mod:`~xlaunch.tune.processes` -- children that die with the tuner; standard streams that never stop it

The launcher (``xlaunch``) never imports this package; this package imports rich, matplotlib
and optuna only where they are used.
"""
from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable


def main() -> None:
    """Console-script entry point (``xlaunch-tune``). A Ctrl-C while the command starts (its imports,
    its checks of the options and the space) or after the session (while its files are written) is
    exit 130 without a traceback; during the session the tuner stops the running trial and keeps
    what was measured (:mod:`~xlaunch.tune.session`)."""
    from xlaunch._early_signals import run_console_script

    def load() -> "Callable[[], object]":
        from xlaunch.tune.cli import main as run_cli

        return run_cli

    run_console_script(load)
