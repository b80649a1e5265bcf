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
* :mod:`~xlaunch.tune.report`, :mod:`~xlaunch.tune.plot`, :mod:`~xlaunch.tune.progress` -- output
* :mod:`~xlaunch.tune.cli`        -- the command line

The launcher (``xlaunch``) never imports this package; this package imports rich, matplotlib
and optuna only where they are used.
"""
