"""Optional dependencies, imported where they are used: the transfer core itself needs numpy and
cffi only (S5).

`staging.py` and `cuda/` work on torch tensors, and `cuda/` drives the GPU through cuda-python
(`cuda.driver.load_driver`). Importing those modules needs neither; the first call that does
gets an ImportError naming the extra of the standalone distribution that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require_torch(user: str) -> ModuleType:
    """The `torch` module, or an ImportError saying that `user` needs it and how to get it."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise ImportError(f"{user} needs torch, which is not installed: pip install "
                          "'./transfer_core[torch]' (or torch itself)") from exc
