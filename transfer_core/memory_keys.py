"""Memory keys nobody can guess (S5, "Who can write what").

A key is all a peer needs to write a registered region, so keys are never sequential (a
process that reaches the fabric could write a peer's KV with key 1 at offset 0): a domain
registers under the provider's own key where the provider chooses them (FI_MR_PROV_KEY),
else under a random one of the provider's key size, drawn again when it is taken.
"""

from __future__ import annotations

import errno
import logging
import secrets

from transfer_core.pyfabric import FabricError, FabricStack, Info, MemoryRegistration, lib

logger = logging.getLogger(__name__)

# A requested key already in use: libfabric 1.17 says FI_ENOKEY on every provider here; EEXIST
# is what a provider keeping keys in a plain map may say. Each retry draws a fresh random key.
_DUPLICATE_KEY = {lib.FI_ENOKEY, errno.EEXIST}
_KEY_ATTEMPTS = 8


def random_key(key_size: int) -> int:
    """A random memory key of `key_size` bytes (at most 64 bits), from `secrets`."""
    return secrets.randbits(8 * min(key_size, 8))


def register_unguessable(stack: FabricStack, info: Info, ptr: int, length: int, access: int,
                         cuda_device: int | None) -> MemoryRegistration:
    """Register `length` bytes at `ptr` with `stack`'s domain under a key nobody can guess:
    the provider's own under FI_MR_PROV_KEY, else a random one of its key size. Keys are
    unique per domain: a duplicate (FI_ENOKEY, or EEXIST) draws another, up to
    `_KEY_ATTEMPTS` times."""
    if info.mr_mode & lib.FI_MR_PROV_KEY:
        return MemoryRegistration(stack.domain, ptr, length, access, 0, stack.endpoint,
                                  cuda_device)
    attempts = 0
    while True:
        key = random_key(info.mr_key_size)
        attempts += 1
        try:
            return MemoryRegistration(stack.domain, ptr, length, access, key, stack.endpoint,
                                      cuda_device)
        except FabricError as exc:
            if exc.errno not in _DUPLICATE_KEY or attempts == _KEY_ATTEMPTS:
                raise
            logger.info("memory key %#x is taken, drawing another", key)
