"""``xlaunch --share-imports``: instances forked from one process that imported the modules once.

:mod:`.server` is the fork server, run as a program of its own; :mod:`.client` is the runner's side
(start a server per :class:`~xlaunch.launcher.plan.records.ImportServer`, fork instances through it).
The decision of which servers and instances is :mod:`xlaunch.launcher.plan.shared`'s.
"""
