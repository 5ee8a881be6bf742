"""Errors of `pyfabric` and the one `check` helper that turns libfabric return codes into them.

The exception classes live in `transfer_core.errors` (the only import from outside this
package, so `pyfabric` can be lifted out later with a copy of that file). Every failed fi_*
call raises `FabricError(call, errno, fi_strerror text)` (S5).
"""

from __future__ import annotations

from transfer_core.errors import FabricError, ProviderNotFoundError

from ._pyfabric import ffi, lib

__all__ = ["FabricError", "ProviderNotFoundError", "check", "fabric_error", "strerror"]


def strerror(errno: int) -> str:
    """libfabric's text for a positive or negative FI_* / errno value."""
    return ffi.string(lib.fi_strerror(abs(errno))).decode(errors="replace")


def fabric_error(call: str, rc: int) -> FabricError:
    return FabricError(call, abs(rc), strerror(rc))


def check(call: str, rc: int) -> int:
    """Return `rc` if it is not negative, else raise the matching `FabricError`."""
    if rc < 0:
        raise fabric_error(call, rc)
    return rc
