"""Build hook of the standalone `transfer-core` distribution (pyproject.toml holds the metadata).

setuptools has no pyproject key for cffi's out-of-line API modules, so they are listed here,
relative to this directory; each builder reads its C sources next to itself (S5, S3b). This
directory is the package, so `build_py` is told to leave this file and the two cffi builders
out of it (the wheel holds what they build, not them; the sdist holds them), and the build
tree and egg-info go to a temporary directory: a `build/` left inside the package would hold
a second copy of it.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

# (package, module) of the files that build the package and are not part of it.
BUILD_FILES = {
    ("transfer_core", "setup"),
    ("transfer_core", "_poller_build"),
    ("transfer_core.pyfabric", "_build"),
}


class BuildPy(build_py):
    """`build_py` without the build files."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) not in BUILD_FILES]


scratch = tempfile.mkdtemp(prefix="transfer-core-build-")
atexit.register(shutil.rmtree, scratch, ignore_errors=True)
setup(
    cmdclass={"build_py": BuildPy},
    options={"build": {"build_base": scratch}, "egg_info": {"egg_base": scratch}},
    cffi_modules=["pyfabric/_build.py:ffibuilder", "_poller_build.py:ffibuilder"],
)
