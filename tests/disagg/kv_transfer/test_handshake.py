"""The handshake's ownership proof (S5), written into the decoder's last context slot.

Over the in-process loopback fabric: `write_proof` from a prefiller engine's context slots into
a decoder engine's context region, read back with `read_proof`; a Hello naming another engine's
regions is refused (`check_bound`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from disagg.errors import RequestError
from disagg.kv_transfer.context_slot import ContextSlots, allocate_context_buffer
from disagg.kv_transfer.handshake import check_bound, clear_proof, read_proof, write_proof
from disagg.kv_transfer.messages import Hello
from tests.disagg.kv_transfer.messenger_harness import tiny_model
from transfer_core.errors import TransferTimeoutError
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric

Engines = tuple[LoopbackEngine, LoopbackEngine]


@pytest.fixture
def engines() -> Iterator[Engines]:
    """A prefiller's and a decoder's engine (the decoder with two endpoints), inline."""
    fabric = LoopbackFabric()
    prefill = LoopbackEngine(fabric=fabric, deliver_inline=True)
    decode = LoopbackEngine(fabric=fabric, num_domains=2, deliver_inline=True)
    yield prefill, decode
    prefill.close()
    decode.close()


def _hello(engine: LoopbackEngine, context: bytes, kv: bytes) -> Hello:
    return Hello("decode-0", "m", "float32", 4, "NHD", 2, 4, 8, engine.address, [kv], context,
                 0)


def test_proof_shares_land_one_per_endpoint(engines: Engines) -> None:
    """The proof's shares land in the decoder's last slot, one per endpoint of the decoder;
    `read_proof` answers with their XOR, the nonce `write_proof` returned. One share alone
    (what a process owning one endpoint could read) is not it."""
    prefill, decode = engines
    model = tiny_model().config
    slots = ContextSlots(prefill, model, 2)
    context = allocate_context_buffer(model, 4)
    _, ctx = decode.register_memory(context, remote_write=True)
    _, kv = decode.register_memory(torch.zeros(64))
    clear_proof(context)
    nonce = write_proof(slots, prefill, _hello(decode, ctx.to_bytes(), kv.to_bytes()), ctx)
    proof = read_proof(context, decode.num_domains, timeout_s=1.0)
    assert proof.nonce == nonce
    assert not context[:-1].any()  # nothing outside the proof slot
    one_share = read_proof(context, 1, timeout_s=1.0)
    assert one_share.nonce != nonce
    slots.close()


def test_hello_naming_regions_of_another_engine_is_refused(engines: Engines) -> None:
    """A Hello whose KV region sits at another engine than its engine address (a forged Hello
    aiming a prefiller at a victim while proving with its own memory) is refused."""
    attacker, victim = engines
    _, victim_kv = victim.register_memory(torch.zeros(64))
    _, own_ctx = attacker.register_memory(torch.zeros(64))
    hello = _hello(attacker, own_ctx.to_bytes(), victim_kv.to_bytes())
    with pytest.raises(RequestError, match="not at the engine address"):
        check_bound(hello)
    mixed = dataclasses.replace(hello, kv_descriptors=[own_ctx.to_bytes()],
                                draft_kv_descriptor=victim_kv.to_bytes())
    with pytest.raises(RequestError, match="not at the engine address"):
        check_bound(mixed)
    check_bound(dataclasses.replace(mixed, draft_kv_descriptor=b""))


def test_no_proof_is_a_timeout(engines: Engines) -> None:
    """Nothing landed: `read_proof` gives up after its timeout, naming the proof."""
    context = allocate_context_buffer(tiny_model().config, 2)
    with pytest.raises(TransferTimeoutError, match="proof"):
        read_proof(context, 1, timeout_s=0.05)


def test_a_region_of_one_slot_cannot_be_proved(engines: Engines) -> None:
    """A decoder context region with room for the proof slot only is refused by name."""
    prefill, decode = engines
    model = tiny_model().config
    slots = ContextSlots(prefill, model, 1)
    context = allocate_context_buffer(model, 1)
    _, ctx = decode.register_memory(context)
    _, kv = decode.register_memory(torch.zeros(64))
    with pytest.raises(RequestError, match="besides the proof slot"):
        write_proof(slots, prefill, _hello(decode, ctx.to_bytes(), kv.to_bytes()), ctx)
    slots.close()
