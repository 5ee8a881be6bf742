"""A request's two immediates: the body is checked before the tail lands (S4c, X4b, X8d).

The decoder counts a request's pages in every layer but the last under one value (the body)
and the last layer, draft pages and context under another (the tail). When the body's counter
fires it sums those layers at once, while the prefiller still computes the last one, and only
once both have fired does it check and release the request. Here one value's arrivals are lost
on purpose (`drop_imm`: the bytes land, the immediates do not count) and delivered later by
hand, so each order can be watched: body first (summed, still waiting), tail first (waiting,
nothing summed), and the pages of an abandoned request wait for both fences.
"""

from __future__ import annotations

from disagg.config import ReliabilityConfig
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import FailureCause, Request, RequestState, SamplingParams
from disagg.kv_transfer.kv_checksum import replica_sums
from disagg.kv_transfer.quarantine import PageQuarantine, Verdict
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    Harness,
    random_prompt,
    single_node_tokens,
    tiny_model,
)
from transfer_core.testing.loopback import LoopbackEngine

PATIENT = ReliabilityConfig(quarantine_timeout_s=30.0)  # a fence must free pages, not a timer


def deliver(h: Harness, imm: int, count: int) -> None:
    """`count` arrivals of `imm` on the decoder, as if its writes' immediates came now."""
    h.decode_transfer.drop_imm(None)
    h.decode_transfer.arrive(0, imm, count)


def test_the_body_is_summed_while_the_tail_is_still_on_its_way(
        make_harness: MakeHarness) -> None:
    """The tail's immediates are held back: the body's counter fires, the decoder sums every
    layer but the last of what landed (over both shards, as a full check would read them) and
    keeps waiting; when the tail's arrive, the request is checked, released and decodes
    the single-node tokens."""
    h = make_harness(decode_tp=2, reliability=PATIENT)
    prompt = random_prompt(11, seed=51)
    request = h.submit(prompt)
    pending = h.decode.pending["r0"]
    h.decode_transfer.drop_imm(lambda imm: imm == pending.tail_imm)
    h.run_until(lambda: pending.body_landed)
    h.run_until(lambda: h.prefill.num_in_flight == 0)  # every write landed: the tail too
    body = range(tiny_model().config.num_layers - 1)
    cache = h.decode_parts.kv_cache
    assert pending.body_sums == replica_sums(cache, request.page_ids, len(prompt) - 1,
                                             layers=body)
    assert len(pending.body_sums) == 1 and pending.body_sums[0] != 0  # one copy of 2 shards
    assert (h.decode.pending.get("r0"), request.state) == (pending, RequestState.WAITING_FOR_KV)
    assert h.decode_transfer.imm_counters.soon_count() == 1, "the last layer is due"
    deliver(h, pending.tail_imm, pending.expected.tail)
    h.run_to_end(request)
    assert h.outcomes_of("r0") == [(RequestState.RUNNING, None)]
    assert request.output_token_ids == single_node_tokens(prompt)
    assert h.decode_transfer.imm_counters.soon_count() == 0
    h.check_clean()


def test_a_request_given_up_while_its_tail_is_due_leaves_nothing_marked_due(
        make_harness: MakeHarness) -> None:
    """Aborted after its body landed, with its tail's immediates lost: its tail is marked due
    (`expect_soon`: a napping receiver naps short) until the request is quarantined, where its
    tail's counter is removed and the mark with it."""
    h = make_harness(reliability=PATIENT)
    request = h.submit(random_prompt(11, seed=53))
    pending = h.decode.pending["r0"]
    h.decode_transfer.drop_imm(lambda imm: imm == pending.tail_imm)
    h.run_until(lambda: pending.body_landed)
    assert h.decode_transfer.imm_counters.soon_count() == 1
    assert h.decode.abort("r0")
    h.run_until(lambda: "r0" not in h.decode.pending)
    assert h.decode_transfer.imm_counters.soon_count() == 0


def test_a_tail_that_lands_first_waits_for_the_body(make_harness: MakeHarness) -> None:
    """The body's immediates are held back: the tail's counter fires first and the request
    keeps waiting, unsummed; once the body's arrive it is summed, checked and released."""
    h = make_harness(reliability=PATIENT)
    prompt = random_prompt(9, seed=52)
    request = h.submit(prompt)
    pending = h.decode.pending["r0"]
    h.decode_transfer.drop_imm(lambda imm: imm == pending.imm)
    h.run_until(lambda: pending.tail_landed)
    for _ in range(3):
        h.pump()
    assert (pending.body_landed, pending.body_sums, h.outcomes) == (False, [], [])
    assert request.state is RequestState.WAITING_FOR_KV
    deliver(h, pending.imm, pending.expected.body)
    h.run_to_end(request)
    assert h.outcomes_of("r0") == [(RequestState.RUNNING, None)]
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()


def test_abandoned_pages_wait_for_the_fences_of_both_immediates() -> None:
    """A quarantined request whose prefiller posted 2 writes under the body's value and 1
    under the tail's: its pages stay pinned until both counts arrived, whichever comes
    first, then go back to the allocator."""
    allocator = PageAllocator(8)
    verdict = Verdict(RequestState.FINISHED_ABORTED, FailureCause.ABORTED, "test")
    with LoopbackEngine(deliver_inline=True) as engine:
        quarantine = PageQuarantine(engine, allocator, timeout_s=30.0)
        for first, then in (((11, 2), (12, 1)), ((12, 1), (11, 2))):
            request = Request("r0", [1, 2, 3], SamplingParams())
            request.page_ids = allocator.allocate(2, pinned=True)
            quarantine.hold(request, (11, 12), (2, 1), verdict, 0.0, expected_writes=(0, 0))
            assert 11 in quarantine and 12 in quarantine and len(quarantine) == 1
            engine.arrive(0, *first)
            assert quarantine.release_due() == [] and allocator.num_free == 6
            engine.arrive(0, *then)
            (released,) = quarantine.release_due()
            assert released.request is request and allocator.num_free == 8
            assert len(quarantine) == 0 and quarantine.forced_releases == 0
            assert engine.pending_imm_counts() == {}
