"""`HTTPConfig`: where the front door listens and how much it admits (X1).

Apart from `launch.py` so that the command line can quote its defaults without importing the
server (uvicorn, the model loader) when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HTTPConfig:
    """Where the API listens and how much it admits."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_in_flight: int = 256  # one more is answered 429
    model_name: str | None = None  # the name clients use (default: the --model spec)
