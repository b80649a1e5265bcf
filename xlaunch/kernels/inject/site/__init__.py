"""Holds the ``sitecustomize`` that ``xlaunch --auto-optimize`` puts first on ``PYTHONPATH``.

This directory is added to the child's path as is; it is a package only so that it ships in
wheels. Nothing imports it as ``xlaunch.kernels.inject.site``."""
