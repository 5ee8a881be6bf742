"""The messengers against a stranger on the fabric (S5), over the loopback fabric.

The attacker is a third `LoopbackEngine` on the harness's fabric, or a second connection to
the prefiller. It knows everything that travels in the clear (the decoder's Hello, hence its
descriptors and engine address; even a request's immediate value, in the worst case) but cannot
read the decoder's memory. It may fire a request's counter with zero-byte immediates, flood
values nobody armed, forge a Hello naming the decoder's memory, and write with a key it holds.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterator

import pytest
import torch

from disagg.config import ReliabilityConfig
from disagg.control.channel import Channel
from disagg.engine.request import FailureCause, RequestState
from disagg.errors import RequestError
from disagg.kv_transfer.context_slot import new_nonce
from disagg.kv_transfer.messages import HelloProof, KVRequest
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    Harness,
    random_prompt,
    receive_ready,
    single_node_tokens,
)
from transfer_core.imm_counter import MAX_UNARMED_IMMS
from transfer_core.memory import MemoryRegionDescriptor
from transfer_core.testing.loopback import LoopbackEngine

RUNNING, WAITING_FOR_KV = RequestState.RUNNING, RequestState.WAITING_FOR_KV
# A retry only after the first attempt's writes (still landing) have all been made.
GRACE = ReliabilityConfig(kv_timeout_s=30.0, quarantine_timeout_s=0.5, max_attempts=2)


Attacker = Callable[[Harness], tuple[LoopbackEngine, MemoryRegionDescriptor]]


@pytest.fixture
def attacker_of() -> Iterator[Attacker]:
    """Factory: an engine on a harness's fabric, and the decoder's context region as its Hello
    tells it; every engine made is closed after the test."""
    made: list[LoopbackEngine] = []

    def make(h: Harness) -> tuple[LoopbackEngine, MemoryRegionDescriptor]:
        made.append(LoopbackEngine(fabric=h.fabric, deliver_inline=True))
        return made[-1], MemoryRegionDescriptor.from_bytes(h.decode.hello().context_descriptor)

    yield make
    for engine in made:
        engine.close()


def test_zero_byte_immediates_firing_a_counter_are_refused(make_harness: MakeHarness,
        attacker_of: Attacker) -> None:
    """Knowing a request's immediates, the attacker fires its counters with zero-byte writes
    before any KV was written: zero pages under a zero context slot sum to a zero checksum, but
    the slot lacks the request's nonce, so the decoder refuses it (CHECKSUM) and retries
    instead of decoding garbage; the retry decodes the single-node tokens."""
    h = make_harness(reliability=GRACE)
    prompt = random_prompt(10, seed=31)
    request = h.submit(prompt)  # its KVRequest waits, unread, in the prefiller's channel
    pending = h.decode.pending["r0"]
    attacker, context = attacker_of(h)
    for imm, writes in zip(pending.imms, pending.armed, strict=True):
        for _ in range(writes):
            attacker.post_imm(imm, context)
    h.step_decoder()
    assert "r0" not in h.decode.pending and len(h.decode.quarantine) == 1  # refused, held
    assert (request.state, request.output_token_ids) == (WAITING_FOR_KV, [])
    h.run_to_end(request)
    assert h.outcomes_of("r0") == [(WAITING_FOR_KV, FailureCause.CHECKSUM), (RUNNING, None)]
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()


def test_a_flood_of_unarmed_immediates_is_bounded_and_harmless(make_harness: MakeHarness,
        attacker_of: Attacker) -> None:
    """Immediates for the values a sequential decoder would arm next (1, 2, 3, ...) and more:
    at most `MAX_UNARMED_IMMS` values are kept, the rest dropped and counted; the next request
    neither fires early nor fails, and decodes the single-node tokens."""
    h = make_harness()
    attacker, context = attacker_of(h)
    for imm in range(1, MAX_UNARMED_IMMS + 101):
        attacker.post_imm(imm, context)
    assert h.decode_transfer.dropped_imms == 100
    prompt = random_prompt(9, seed=32)
    request = h.submit(prompt)
    h.run_to_end(request)
    assert h.outcomes_of("r0") == [(RUNNING, None)]
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()


def test_a_forged_hello_gets_no_request_and_writes_nothing(make_harness: MakeHarness) -> None:
    """A Hello carrying the decoder's own descriptors and address, from a connection that is
    not the decoder: the prefiller writes its proof into the decoder's proof slot, which the
    attacker cannot read; every guess is refused, and so is any request, before a byte of the
    decoder's KV or context slots changes."""
    h = make_harness()
    forged = dataclasses.replace(h.decode.hello(), node_id="attacker")
    a, b = socket.socketpair()
    channel = Channel(b, "attacker", secret=b"")
    h.extra_channels += [Channel(a, "prefill-0", secret=b""), channel]
    peer = h.prefill.add_peer(forged, channel)
    for guess in (0, 1, new_nonce()):
        with pytest.raises(RequestError, match="wrong ownership proof"):
            h.prefill.accept_proof(peer, forged, HelloProof(guess))
    evil = KVRequest("evil", 7, 8, random_prompt(9, seed=33), [0, 1, 2], 0, nonce=new_nonce())
    with pytest.raises(RequestError, match="has not proved"):
        h.prefill.start_request(evil, peer)
    assert h.prefill.num_in_flight == 0
    assert not any(shard.buffer.any() for shard in h.decode_parts.kv_cache.shards)
    assert not h.decode.context[:-1].any()


def test_sources_are_not_writable_by_peers(make_harness: MakeHarness,
        attacker_of: Attacker) -> None:
    """The prefiller's KV and context slots are registered without remote write: their
    descriptors say read-only, and a write with their real key lands nothing. The decoder's
    KV and context slots, which prefillers must write, are writable."""
    h = make_harness()
    attacker, _ = attacker_of(h)
    prefill_kv, slots = h.prefill.kv[0].descriptor, h.prefill.context.slots.region.descriptor
    assert (prefill_kv.writable, slots.writable) == (False, False)
    assert h.decode.kv[0].descriptor.writable
    assert MemoryRegionDescriptor.from_bytes(h.decode.hello().context_descriptor).writable
    source = attacker.register_memory(torch.full((16,), 7.0))[0]
    attacker.post_write(source, 0, 64, 3, dataclasses.replace(prefill_kv, writable=True), 0)
    assert not any(shard.buffer.any() for shard in h.prefill_parts.kv_cache.shards)


def test_requests_get_random_imms_fresh_nonces_and_never_the_proof_slot(
        make_harness: MakeHarness) -> None:
    """Twenty requests at once: fifteen get one of the sixteen context slots (the last is the
    proof slot), with immediates (two each) that are random (not 1, 2, 3, ...) and distinct,
    and a fresh nonce each, sent in their KVRequest; all then decode the single-node tokens."""
    h = make_harness()
    prompts = [random_prompt(3, seed=40 + i) for i in range(20)]
    requests = [h.submit(p, f"r{i}") for i, p in enumerate(prompts)]
    pending = list(h.decode.pending.values())
    assert len(pending) == 15 and max(p.context_slot for p in pending) < 15
    imms = [imm for p in pending for imm in p.imms]
    assert len(set(imms)) == 30 and 0 not in imms and max(imms) > 2**20
    sent = receive_ready(h.prefill_channel, h.decode_channel)
    assert [m.nonce for m in sent] == [p.nonce for p in pending]
    assert [(m.imm, m.tail_imm) for m in sent] == [p.imms for p in pending]
    assert len({m.nonce for m in sent}) == 15 and 0 not in {m.nonce for m in sent}
    for message in sent:  # the prefiller gets them as if read by `pump`
        assert h.peer is not None
        h.prefill.start_request(message, h.peer)
    h.run_until(lambda: all(r.is_finished for r in requests) and h.idle(), timeout_s=20.0)
    assert [r.output_token_ids for r in requests] == [single_node_tokens(p) for p in prompts]
    h.check_clean()
