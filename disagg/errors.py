"""Exceptions of `disagg`: one place, so callers (and the CLI) can catch by kind.

Every error here is about input the user can fix (a model name, a checkpoint, a prompt, a
cache size); the CLI turns them into a one-line message and exit code 2.
"""

from __future__ import annotations


class DisaggError(Exception):
    """Base class of every error `disagg` raises on purpose."""


class ConfigError(DisaggError, ValueError):
    """A configuration value is invalid or two values contradict each other."""


class ModelLoadError(DisaggError):
    """A model name is unknown or a checkpoint is missing or malformed."""


class RequestError(DisaggError, ValueError):
    """A request cannot be served as given (empty prompt, too long for the cache, ...)."""


class GuideError(RequestError):
    """A structured-output spec (JSON schema, regex, choice, grammar) cannot be compiled, or
    the model's tokens cannot follow it."""


class OutOfPagesError(DisaggError):
    """The page allocator has fewer free pages than asked for."""


class ProtocolError(DisaggError):
    """A control message is malformed, truncated, of an unknown type or version."""


class InvalidMessage(ProtocolError):
    """A whole, authentic frame whose payload is wrong (a field missing, of the wrong type or
    out of range): the stream is intact, so only that message is refused. `request_id` is the
    payload's, when it names one, so the request can be failed alone."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class PeerMismatchError(DisaggError):
    """A peer's model, dtype, page size, layout or protocol version differs from ours."""


class PeerClosedError(DisaggError):
    """The peer closed the control connection (or it broke)."""


class RankError(DisaggError):
    """A tensor-parallel rank process failed to start, sent something wrong, or died."""


class PreflightError(DisaggError):
    """Something a run needs from this machine is not there, found before any model loads: a
    port already in use, a libfabric provider the machine lacks (`node/preflight.py`)."""


class KernelError(DisaggError, RuntimeError):
    """A CPU kernel of the model (`model/cpu_kernels.py`) refused its inputs: a page id outside
    the cache, a length beyond its page table. The engine's own pages never do; if they did,
    the step's requests would fail (X5a), as the PyTorch path's IndexError fails them."""
