"""Build hook for the cffi extension modules (pyproject.toml holds the metadata).

setuptools has no pyproject key for cffi's out-of-line API modules, so they are listed here.
`transfer_core/setup.py` is the build hook of the standalone transfer-core distribution, not a
module of the package: `build_py` leaves it out of this one too.
"""

from __future__ import annotations

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """`build_py` without `transfer_core/setup.py`."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if (m[0], m[1]) != ("transfer_core", "setup")]


setup(
    cmdclass={"build_py": BuildPy},
    cffi_modules=[
        "transfer_core/pyfabric/_build.py:ffibuilder",
        "transfer_core/_poller_build.py:ffibuilder",
        "disagg/model/_cpu_kernels_build.py:ffibuilder",
    ],
)
