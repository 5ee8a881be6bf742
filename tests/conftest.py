"""Settings every test session under `tests/` shares."""

from __future__ import annotations

import os
import sys

# pytest rewrites the asserts of every test module it imports (about 500 here) and keeps the
# result in __pycache__ only where Python may write bytecode. Where PYTHONDONTWRITEBYTECODE is
# set (some containers set it) every session, and every xdist worker of it, redid all of it:
# about 6 s of each collection on 2 cores. __pycache__ is ignored by git. The node processes
# the tests spawn inherit the environment, so they keep their bytecode too.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
