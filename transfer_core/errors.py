"""Exceptions of `transfer_core`, built from the outside library's own error text.

`FabricError` carries libfabric's errno and `fi_strerror` string; `CudaError` carries the
CUresult name. Asynchronous failures reach callers through `on_error` callbacks holding one
of these, never as a swallowed exception.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error `transfer_core` raises on purpose."""


class FabricError(TransferError):
    """A libfabric call failed: `errno` is the positive FI_* error number."""

    def __init__(self, call: str, errno: int, text: str) -> None:
        self.call = call
        self.errno = errno
        self.text = text
        super().__init__(f"{call} failed: {text} (fi errno {errno})")


class ProviderNotFoundError(TransferError):
    """No libfabric provider on this host matches the preference list and capabilities."""


class BoundsError(TransferError, ValueError):
    """A write would read or write outside its registered memory region."""


class DescriptorError(TransferError, ValueError):
    """A serialised address or memory descriptor is malformed or from another version."""


class TransferTimeoutError(TransferError, TimeoutError):
    """An operation did not complete before its deadline."""


class PeerError(TransferError):
    """A remote peer is unreachable, closed the connection or rejected an operation."""


class CudaError(TransferError):
    """A CUDA driver call failed, or CUDA is needed but absent."""

    def __init__(self, call: str, result: str) -> None:
        self.call = call
        self.result = result
        super().__init__(f"{call} failed: {result}")


class ReferenceToolError(TransferError):
    """A reference tool measured beside ours (libfabric's `fi_rma_bw`) is missing or failed."""
