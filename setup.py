"""Build hook for the cffi extension modules (pyproject.toml holds the metadata).

setuptools has no pyproject key for cffi's out-of-line API modules, so they are listed here.
"""

from setuptools import setup

setup(
    cffi_modules=[
        "transfer_core/pyfabric/_build.py:ffibuilder",
        "transfer_core/_poller_build.py:ffibuilder",
    ],
)
