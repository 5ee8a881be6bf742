"""What the parts of `gpu_check.py` share: the seed and the shape of a result row."""

from __future__ import annotations

SEED = 1234
# (check, passed, value, detail): one line of the summary table.
Row = tuple[str, bool, str, str]
