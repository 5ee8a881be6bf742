"""What the parts of `gpu_check.py` share: the seed and the shape of a result row."""

from __future__ import annotations

import torch

SEED = 1234
# (check, passed, value, detail): one line of the summary table.
Row = tuple[str, bool, str, str]


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work; nothing to wait for on CPU (the dry run)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
