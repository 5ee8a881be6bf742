"""The context slot (S4a, S5): the request nonce and the KV checksum packed next to the hidden
state, and why a slot nobody wrote, or another request's, never passes."""

from __future__ import annotations

import pytest
import torch

from disagg.kv_transfer.context_slot import (
    allocate_context_buffer,
    context_checksum,
    context_nonce,
    new_nonce,
    pack_context,
    slot_matches,
)
from tests.disagg.kv_transfer.messenger_harness import tiny_model


@pytest.mark.parametrize("nonce", [1, 2**63, 2**64 - 1, 0x0123456789ABCDEF])
def test_nonce_and_checksum_round_trip(nonce: int) -> None:
    """The nonce (all 64 bits) and the float64 checksum come back exactly, side by side."""
    model = tiny_model().config
    slot = allocate_context_buffer(model, 1)[0]
    pack_context(slot, torch.ones(model.hidden_size), -1.25, nonce)
    assert (context_nonce(slot, model), context_checksum(slot, model)) == (nonce, -1.25)
    assert slot_matches(slot, model, nonce, -1.25, "r0")


def test_zero_or_foreign_slot_never_matches() -> None:
    """A slot nobody wrote holds nonce 0 and checksum 0: zero pages (checksum 0) under it must
    not pass, nor a slot packed for another request, nor a wrong checksum."""
    model = tiny_model().config
    slot = allocate_context_buffer(model, 1)[0]
    mine, other = new_nonce(), new_nonce()
    assert mine != 0 and not slot_matches(slot, model, mine, 0.0, "r0")
    pack_context(slot, torch.zeros(model.hidden_size), 3.0, other)
    assert not slot_matches(slot, model, mine, 3.0, "r0")
    assert not slot_matches(slot, model, other, 2.0, "r0")
