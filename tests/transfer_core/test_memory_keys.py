"""Memory keys nobody can guess (S5): redrawn when taken, the provider's own kept."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from transfer_core import memory_keys
from transfer_core.engine import TransferEngine
from transfer_core.pyfabric import lib

PAGE = 4096


def test_a_duplicate_key_draws_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key the provider reports as taken (FI_ENOKEY) is redrawn; the region registers."""
    draws = iter([0xC0FFEE, 0xC0FFEE, 0xBEEF])
    with TransferEngine("tcp") as a:
        monkeypatch.setattr(memory_keys, "random_key", lambda _size: next(draws))
        _, first = a.register_memory(np.zeros(PAGE, np.uint8))
        _, second = a.register_memory(np.zeros(PAGE, np.uint8))
    assert (first.domains[0][1], second.domains[0][1]) == (0xC0FFEE, 0xBEEF)


def test_provider_chosen_keys_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FI_MR_PROV_KEY the binding requests key 0 and uses what fi_mr_key says."""
    requested: list[int] = []
    monkeypatch.setattr(memory_keys, "MemoryRegistration",
                        lambda *args: requested.append(args[4]) or SimpleNamespace(key=77))
    stack = SimpleNamespace(domain=None, endpoint=None)
    info = SimpleNamespace(mr_mode=lib.FI_MR_PROV_KEY)
    registration = memory_keys.register_unguessable(stack, info, 4096, 64, 0, None)  # type: ignore[arg-type]
    assert (requested, registration.key) == ([0], 77)


def test_random_keys_use_the_key_size() -> None:
    """A key never has more bytes than the provider's key size (at most 8)."""
    assert all(memory_keys.random_key(2) < 2**16 for _ in range(200))
    assert any(memory_keys.random_key(8) >= 2**56 for _ in range(200))  # odds of failing: 2^-1600
