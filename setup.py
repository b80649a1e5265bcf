"""The wheel's one build step beyond pyproject.toml: the C++ kernels of xlaunch.nn and xlaunch.llm,
prebuilt at every ISA level into ``xlaunch/<package>/prebuilt/`` (``pip wheel --no-build-isolation .``
against the installed torch; a build the cache already holds is copied, not recompiled). The
files are keyed by torch's version, so an installed wheel never loads them under another torch.
Without torch or a compiler at build time the wheel carries the sources only, and says so.
``XLAUNCH_WHEEL_KERNELS=0`` skips the kernels.
"""
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        # An editable install (make setup) runs from the tree: its kernels are built into the cache.
        if os.environ.get("XLAUNCH_WHEEL_KERNELS", "1") == "0" or getattr(self, "editable_mode", False):
            return
        sys.path.insert(0, str(ROOT))
        try:
            from xlaunch.llm import native as llm_native
            from xlaunch.nn import native as nn_native
        except ImportError as exc:
            print(f"xlaunch: warning: no prebuilt kernels in this wheel ({exc})", file=sys.stderr)
            return
        for library in (nn_native.LIBRARY, llm_native.LIBRARY):
            if ROOT not in library.csrc.parents:
                raise RuntimeError(f"building the wheel of {ROOT} imported {library.csrc.parent} instead")
            into = Path(self.build_lib) / library.csrc.parent.relative_to(ROOT) / "prebuilt"
            try:
                library.build(into=into)
            except RuntimeError as exc:
                print(f"xlaunch: warning: no prebuilt {library.label} kernels in this wheel ({exc})", file=sys.stderr)


class BinaryDistribution(Distribution):
    """The prebuilt kernels make the wheel platform-specific (x86-64 Linux)."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """Tagged ``py3-none-<platform>``, not ``cp311-cp311-<platform>``: the kernels link torch's libraries, not
    Python's (their names hold torch's version), so one wheel serves every Python torch has a build for."""

    def get_tag(self) -> tuple:
        return ("py3", "none", super().get_tag()[2])


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
