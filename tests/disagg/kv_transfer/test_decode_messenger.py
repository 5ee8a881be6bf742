"""`DecodeMessenger` against a real `PrefillMessenger` over the in-process loopback fabric
(S2a, S2c, S4c; X4: deadlines, retries, aborts, the quarantine fence, the KV checksum).

Each test drives both messengers by hand through `Harness` (no node threads, no libfabric):
what arrives, when the counter fires, what `poll()` reports, and whether every page comes back.
"""

from __future__ import annotations

import pytest

from disagg.config import ReliabilityConfig
from disagg.engine.request import FailureCause, RequestState
from disagg.kv_transfer.messages import Cancel, KVFailed, KVRequest
from disagg.kv_transfer.transfer_plan import ExpectedWrites, expected_write_count
from disagg.kv_transfer.transfer_plan import expected_writes as plan_writes
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    CACHE,
    MAX_TOKENS,
    Harness,
    random_prompt,
    receive_ready,
    single_node_tokens,
    tiny_model,
)

RUNNING, WAITING_FOR_KV = RequestState.RUNNING, RequestState.WAITING_FOR_KV
FAILED, ABORTED = RequestState.FINISHED_FAILED, RequestState.FINISHED_ABORTED
# Deadlines short enough to expire in a unit test; a retried request still has time to finish.
FAST = ReliabilityConfig(kv_timeout_s=0.4, quarantine_timeout_s=0.15, max_attempts=2)
PATIENT = ReliabilityConfig(quarantine_timeout_s=30.0)  # a fence must free pages, not a timer


def expected_writes(prompt_len: int) -> int:
    """Page writes of every layer plus the context write, for the tiny model."""
    return expected_write_count(prompt_len, CACHE.page_size, tiny_model().config.num_layers)


def split_writes(prompt_len: int) -> ExpectedWrites:
    """`expected_writes` under the body's immediate and under the tail's."""
    return plan_writes(prompt_len, CACHE.page_size, tiny_model().config.num_layers)


def decoder_pages_in_use(h: Harness) -> int:
    return h.free_pages[1] - h.decode_parts.allocator.num_free


@pytest.mark.parametrize("length", [1, 2, 5, 23])
def test_loopback_kv_decodes_the_single_node_tokens(make_harness: MakeHarness,
                                                    length: int) -> None:
    """KV prefilled remotely (23 tokens: 6 pages over 5 chunks) decodes exactly the greedy
    tokens of one mixed engine; the request is released `RUNNING` with a receipt of every
    write, and nothing is left on either side."""
    h = make_harness()
    prompt = random_prompt(length, seed=length)
    request = h.submit(prompt)
    h.run_to_end(request)
    assert request.output_token_ids == single_node_tokens(prompt)
    assert request.state is RequestState.FINISHED_LENGTH
    assert h.decode_engine.num_steps == MAX_TOKENS  # no prompt token recomputed but the last
    if length == 1:  # nothing to prefill: the decoder runs the one token itself
        assert (h.outcomes, h.to_prefiller) == ([], [])
    else:
        (outcome,) = h.outcomes
        assert (outcome.state, outcome.cause) == (RUNNING, None)
        assert outcome.receipt is not None
        assert outcome.receipt.writes == expected_writes(length)
    h.check_clean()


def test_threaded_delivery_decodes_the_single_node_tokens(make_harness: MakeHarness) -> None:
    """The same with writes, completions and counters on the loopback engines' own threads."""
    h = make_harness(inline=False)
    prompt = random_prompt(17, seed=3)
    request = h.submit(prompt)
    h.run_to_end(request)
    assert request.output_token_ids == single_node_tokens(prompt)
    assert h.outcomes_of("r0") == [(RUNNING, None)]
    h.check_clean()


def test_lost_immediates_miss_the_deadline_and_the_retry_succeeds(
        make_harness: MakeHarness) -> None:
    """Every immediate of the first attempt is lost: its deadline cancels it, its pages wait in
    quarantine (the fence is never reached, so they go at the quarantine deadline) and the
    retry, with new immediates, decodes the right tokens."""
    h = make_harness(reliability=FAST)
    prompt = random_prompt(11, seed=1)
    request = h.submit(prompt)
    first_imms = h.decode.pending["r0"].imms
    h.decode_transfer.drop_imm(lambda imm: imm in first_imms)
    h.run_until(lambda: len(h.decode.quarantine) == 1)
    assert decoder_pages_in_use(h) == 3  # held, not reused, while writes might still land
    assert any(isinstance(m, Cancel) for m in h.to_prefiller)
    h.run_to_end(request)
    assert h.outcomes_of("r0") == [(WAITING_FOR_KV, FailureCause.DEADLINE), (RUNNING, None)]
    assert request.kv_attempts == 2
    assert request.output_token_ids == single_node_tokens(prompt)
    assert h.decode.quarantine.forced_releases == 1
    assert h.decode_transfer.dropped_imms == expected_writes(11)
    h.check_clean()


def test_lost_immediates_on_every_attempt_fail_with_deadline(make_harness: MakeHarness) -> None:
    """With every immediate lost, the request is retried once (max_attempts=2), then ends
    FINISHED_FAILED with cause DEADLINE; both attempts' pages are freed."""
    h = make_harness(reliability=FAST)
    request = h.submit(random_prompt(6, seed=2))
    h.decode_transfer.drop_imm(lambda imm: True)
    h.run_to_end(request)
    assert h.outcomes_of("r0") == [(WAITING_FOR_KV, FailureCause.DEADLINE),
                                   (FAILED, FailureCause.DEADLINE)]
    assert request.state is FAILED
    assert sum(isinstance(m, Cancel) for m in h.to_prefiller) == 2
    h.check_clean()


def test_prefiller_failure_cause_reaches_the_outcome(make_harness: MakeHarness) -> None:
    """A prefiller that stops a transfer (its lease expired mid-prefill) answers KVFailed
    with LEASE_EXPIRED; the decoder fails the request with that cause, without retrying, and
    frees its pages at the counted fence."""
    h = make_harness(lease_s=0.0, reliability=PATIENT)
    request = h.submit(random_prompt(13, seed=4))
    h.run_to_end(request)
    (failed,) = [m for m in h.to_decoder if isinstance(m, KVFailed)]
    assert failed.cause is FailureCause.LEASE_EXPIRED
    assert 0 < failed.writes_posted + failed.tail_writes_posted < expected_writes(13)
    assert h.outcomes_of("r0") == [(FAILED, FailureCause.LEASE_EXPIRED)]
    assert h.prefill.stats["expired_leases"] == 1
    assert h.decode.quarantine.forced_releases == 0
    h.check_clean()


@pytest.mark.parametrize("cause", [FailureCause.WRITE_FAILED, FailureCause.PREFILLER_REFUSED])
def test_failure_cause_is_the_enum_not_the_reason_text(make_harness: MakeHarness,
                                                        cause: FailureCause) -> None:
    """The outcome's cause is KVFailed.cause, even when the reason text names another one."""
    h = make_harness()
    request = h.submit(random_prompt(6, seed=5))
    (asked,) = receive_ready(h.prefill_channel, h.decode_channel)  # intercepted: the prefiller never starts it
    assert isinstance(asked, KVRequest)
    h.prefill_channel.send(KVFailed("r0", cause, "deadline: KV checksum mismatch", 0, 0))
    h.run_to_end(request)
    outcome = h.outcomes[0]
    # A failed write is retried (then served), a refusal is final.
    then = WAITING_FOR_KV if cause is FailureCause.WRITE_FAILED else FAILED
    assert (outcome.state, outcome.cause) == (then, cause)
    assert "checksum" in outcome.detail
    if cause is FailureCause.WRITE_FAILED:
        assert [o.state for o in h.outcomes] == [WAITING_FOR_KV, RUNNING]
        assert request.output_token_ids == single_node_tokens(request.prompt_token_ids)
    h.check_clean()


def test_abort_mid_transfer_holds_pages_until_written_ones_land(
        make_harness: MakeHarness) -> None:
    """A client abort while the first page's writes are parked in flight: the request ends
    FINISHED_ABORTED only after those writes landed and the prefiller's count of them was
    reached; until then no page of it is free for reuse."""
    h = make_harness(reliability=PATIENT)
    request = h.submit(random_prompt(13, seed=6))
    pages = list(request.page_ids)
    h.prefill_transfer.hold()
    h.run_until(lambda: h.prefill_transfer.held_writes() > 0)  # one chunk: page 0, 2 layers
    assert h.decode.abort("r0")
    for _ in range(5):
        h.pump()
    assert h.outcomes == []
    assert all(h.decode_parts.allocator.is_pinned(p) for p in pages)
    assert h.prefill.num_in_flight == 1  # the cancelled transfer waits for its writes
    h.prefill_transfer.release()
    h.run_to_end(request, timeout_s=3.0)
    assert h.outcomes_of("r0") == [(ABORTED, FailureCause.ABORTED)]
    (failed,) = [m for m in h.to_decoder if isinstance(m, KVFailed)]
    # Page 0 in layer 0 (the body) and in layer 1 (the tiny model's last: the tail).
    assert (failed.cause, failed.writes_posted, failed.tail_writes_posted) == (
        FailureCause.CANCELLED, 1, 1)
    assert h.decode.quarantine.forced_releases == 0
    h.check_clean()


def test_abort_after_every_write_was_posted_frees_pages_at_the_fence(
        make_harness: MakeHarness) -> None:
    """Aborted after the prefiller posted every write (all parked): once they landed and the
    prefiller's KVFailed says how many, the fence is reached and the pages are free at once,
    not at the quarantine deadline."""
    h = make_harness(reliability=PATIENT)
    request = h.submit(random_prompt(9, seed=7))
    h.prefill_transfer.hold()
    h.run_until(lambda: not h.prefill_engine.has_unfinished() and h.prefill.num_in_flight == 1)
    assert h.decode.abort("r0")
    h.pump()  # the Cancel reaches the prefiller, which waits for its parked writes
    h.prefill_transfer.release()
    h.run_until(lambda: bool(h.to_decoder))
    (failed,) = h.to_decoder
    assert isinstance(failed, KVFailed)
    assert (failed.cause, failed.writes_posted, failed.tail_writes_posted) == (
        FailureCause.CANCELLED, split_writes(9).body, split_writes(9).tail)
    for _ in range(3):
        h.pump()
    assert h.decode.quarantine.forced_releases == 0
    assert not h.decode_transfer.pending_imm_counts(), "fence re-armed for arrivals long gone"
    assert h.outcomes_of("r0") == [(ABORTED, FailureCause.ABORTED)]
    assert request.page_ids == []
    assert decoder_pages_in_use(h) == 0


def test_kv_corrupted_in_flight_fails_the_checksum_and_is_retried(
        make_harness: MakeHarness) -> None:
    """The prefiller's KV changes while its writes are in flight (after the checksum was
    packed): the counter fires over wrong bytes, the checksum catches it (cause CHECKSUM),
    and the retry decodes the single-node tokens."""
    h = make_harness(reliability=FAST)
    prompt = random_prompt(10, seed=8)
    request = h.submit(prompt)
    h.prefill_transfer.hold()
    h.run_until(lambda: not h.prefill_engine.has_unfinished() and h.prefill.num_in_flight == 1)
    for shard in h.prefill_parts.kv_cache.shards:
        shard.buffer.add_(0.25)  # what the parked writes will read
    h.prefill_transfer.release()
    h.run_to_end(request)
    assert h.outcomes_of("r0") == [(WAITING_FOR_KV, FailureCause.CHECKSUM), (RUNNING, None)]
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()


def test_a_request_no_prefiller_can_take_fails_and_gives_its_pages_back(
        make_harness: MakeHarness) -> None:
    """Every prefiller is gone: the request fails (NO_PREFILLER) at once and its pages,
    pinned for KV nobody will write, are free again (they used to stay pinned for good)."""
    h = make_harness()
    h.decode.prefiller_gone(0, "test: gone")
    request = h.submit(random_prompt(9, seed=21))
    h.run_until(lambda: bool(h.outcomes_of("r0")))
    assert request.is_finished
    assert h.outcomes_of("r0") == [(FAILED, FailureCause.NO_PREFILLER)]
    assert decoder_pages_in_use(h) == 0
    h.check_clean()
