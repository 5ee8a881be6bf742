"""`HTTPConfig`: where the front door listens, how much it admits, the limits that keep one
client's bytes from costing every client their time (X1, X5b), and the API key it asks for.

Apart from `launch.py` so that the command line can quote its defaults without importing the
server (uvicorn, the model loader) when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class HTTPConfig:
    """Where the API listens, how much it admits, how long it waits for a client, and the
    key a client must send (None: anyone may call it)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_in_flight: int = 256  # one more is answered 429
    model_name: str | None = None  # the name clients use (default: the --model spec)
    # A body past this is answered 413 without being read whole. 8 MiB holds a prompt of a
    # 128k-token context as text or as token ids, with room to spare.
    max_body_bytes: int = 8 * MiB
    max_connections: int = 1024  # open connections; one more is answered 503 and closed
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (else 408)
    keep_alive_timeout_s: float = 5.0  # an idle connection between requests is closed then
    # The request line and headers together; more is answered 431 (h11's default, 16 KiB).
    max_header_bytes: int = 16 * 1024
    # Clients then send `Authorization: Bearer KEY` to /v1/* (`api_key.py`); kept out of repr
    # so that a logged config does not print it.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_body_bytes", "max_connections", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1 (got {getattr(self, name)})")
        for name in ("header_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive (got {getattr(self, name)})")
        if self.api_key is not None and not _is_token(self.api_key):
            # The message leaves the key out: it may be on its way to a log.
            raise ConfigError("api_key must be one or more printable ASCII characters with no "
                              "spaces (what a client can send after `Bearer `)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535 (got {self.port})")


def _is_token(key: str) -> bool:
    return bool(key) and key.isascii() and key.isprintable() and " " not in key
