"""`PrefillMessenger` over the in-process loopback fabric (S2b, S3, S4b; S8, X4).

The prefiller side of `Harness`: the draft-KV plug-in is built only for decoders that ask,
once; a cancelled or orphaned transfer posts nothing more, keeps its source pages while writes
still read them, then frees them and tells the decoder how many writes completed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.control.framing import Message
from disagg.engine.request import FailureCause, RequestState
from disagg.kv_transfer.draft_kv import DraftKVSource, draft_kv_pages
from disagg.kv_transfer.messages import KVFailed, KVRequest
from disagg.kv_transfer.transfer_plan import expected_write_count, expected_writes
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    CACHE,
    Harness,
    random_prompt,
    receive_ready,
    single_node_tokens,
    tiny_model,
)

FAILED = RequestState.FINISHED_FAILED


def prefill_pages_in_use(h: Harness) -> int:
    return h.free_pages[0] - h.prefill_parts.allocator.num_free


def kv_failures(messages: list[Message]) -> list[tuple[str, FailureCause, tuple[int, int]]]:
    """(request id, cause, writes posted under the body's and the tail's immediates) of every
    KVFailed in `messages`."""
    return [(m.request_id, m.cause, (m.writes_posted, m.tail_writes_posted)) for m in messages
            if isinstance(m, KVFailed)]


def split_writes(prompt_len: int) -> tuple[int, int]:
    """A tiny-model request's writes under its body's and its tail's immediates."""
    e = expected_writes(prompt_len, CACHE.page_size, tiny_model().config.num_layers)
    return e.body, e.tail


def test_decoder_without_draft_kv_never_builds_the_draft_source(
        make_harness: MakeHarness) -> None:
    """A Hello without a draft-KV descriptor: a whole request is prefilled and shipped and no
    draft source is built (no MTP head is built for nobody)."""
    h = make_harness()
    assert h.decode.hello().draft_kv_descriptor == b""
    request = h.submit(random_prompt(9, seed=1))
    h.run_to_end(request)
    assert h.prefill.draft is None
    h.check_clean()


def test_draft_source_is_built_once_when_a_decoder_first_asks(make_harness: MakeHarness) -> None:
    """Not at construction; at the first Hello with a draft-KV descriptor; not again for a
    second such decoder. Its pages then count in what the decoder expects."""
    h = make_harness(draft_kv=True, connect=False)
    assert h.prefill.draft is None
    h.handshake()
    built = h.prefill.draft
    assert isinstance(built, DraftKVSource)
    h.extra_peer(replace(h.decode.hello(), node_id="decode-1"))
    assert h.prefill.draft is built
    request = h.submit(random_prompt(14, seed=2))
    h.run_to_end(request)
    (outcome,) = h.outcomes
    assert outcome.state is RequestState.RUNNING
    assert outcome.receipt is not None
    plain = expected_write_count(14, CACHE.page_size, tiny_model().config.num_layers)
    assert outcome.receipt.writes == plain + draft_kv_pages(14, CACHE.page_size)
    assert h.prefill.draft is built
    h.check_clean()


def test_cancel_posts_nothing_more_and_frees_pages_once_writes_completed(
        make_harness: MakeHarness) -> None:
    """Cancelled after its first chunk, with that chunk's writes parked in flight: no later
    chunk, page or context write is posted; the source pages stay allocated while the parked
    writes read them, and are freed once they completed; the decoder is told CANCELLED with
    the count of writes that completed."""
    h = make_harness()
    h.submit(random_prompt(13, seed=3))
    imms = h.decode.pending["r0"].imms
    h.prefill_transfer.hold()
    h.run_until(lambda: h.prefill_transfer.held_writes() > 0)
    posted, in_use = h.prefill.stats["writes"], prefill_pages_in_use(h)
    # Page 0 of both layers; the prefiller holds all 3 pages from admission (it never preempts).
    assert (posted, in_use) == (2, 3)
    assert h.peer is not None
    h.prefill.cancel(h.peer, "r0")
    for _ in range(3):
        h.step_prefiller()
    assert not h.prefill_engine.has_unfinished()
    assert h.prefill_transfer.held_writes() == posted
    assert h.prefill.stats["writes"] == posted
    assert prefill_pages_in_use(h) == in_use  # the parked writes still read them
    assert h.prefill.num_in_flight == 1
    assert receive_ready(h.decode_channel, h.prefill_channel) == []  # not before the writes completed
    h.prefill_transfer.release()
    h.step_prefiller()
    assert (h.prefill.num_in_flight, prefill_pages_in_use(h)) == (0, 0)
    (ended,) = h.prefill.recent
    assert (ended.request.state, ended.cause) == (FAILED, FailureCause.CANCELLED)
    # The parked ones, nothing more: page 0 in layer 0 (the body), in layer 1 (the tail).
    assert [h.decode_transfer.imm_counted(imm) for imm in imms] == [1, 1]
    h.deliver_to_decoder()
    assert kv_failures(h.to_decoder) == [("r0", FailureCause.CANCELLED, (1, 1))]


@pytest.mark.parametrize("min_post_bytes", [0, 1 << 20], ids=["layer_by_layer", "grouped"])
def test_late_cancel_is_answered_with_the_writes_completed(make_harness: MakeHarness,
                                                           min_post_bytes: int) -> None:
    """A Cancel for a transfer that already finished (its counter should have fired) gets
    KVFailed with the writes it completed under each value, the decoder's fence (a group
    of layers counts its last layer's under the tail's, X9a); an unknown id gets -1."""
    h = make_harness(min_post_bytes=min_post_bytes)
    request = h.submit(random_prompt(7, seed=4))
    h.run_to_end(request)
    assert h.peer is not None
    h.prefill.cancel(h.peer, "r0")
    h.prefill.cancel(h.peer, "never-sent")
    assert kv_failures(receive_ready(h.decode_channel, h.prefill_channel)) == [
        ("r0", FailureCause.CANCELLED, split_writes(7)),
        ("never-sent", FailureCause.CANCELLED, (-1, -1))]


def test_fail_peer_ends_every_request_of_that_peer_only(make_harness: MakeHarness) -> None:
    """A gone decoder: its request mid-prefill and its queued one end FINISHED_FAILED with
    DECODER_GONE and their pages are freed; another decoder's request is shipped as usual."""
    h = make_harness()
    h.submit(random_prompt(13, seed=5), "r0")
    h.submit(random_prompt(9, seed=6), "r1")
    other, other_channel = h.extra_peer(replace(h.decode.hello(), node_id="decode-1"))
    other_prompt = random_prompt(10, seed=7)
    h.prefill.start_request(KVRequest("x0", 999, 1000, other_prompt, [60, 61, 62], 15), other)
    h.deliver_to_prefiller()
    h.step_prefiller()  # r0's first chunk
    assert h.prefill.num_in_flight == 3
    assert h.peer is not None
    h.prefill.fail_peer(h.peer, "decoder gone: test")
    h.run_until(lambda: h.prefill.num_in_flight == 0 and not h.prefill_engine.has_unfinished())
    ended = {t.request_id: (t.request.state, t.cause) for t in h.prefill.recent}
    assert ended == {"r0": (FAILED, FailureCause.DECODER_GONE),
                     "r1": (FAILED, FailureCause.DECODER_GONE),
                     "x0": (RequestState.FINISHED_TRANSFERRED, None)}
    assert prefill_pages_in_use(h) == 0
    assert h.prefill.stats["failed"] == 2
    assert sorted(r for r, _, _ in kv_failures(h.to_decoder)) == ["r0", "r1"]
    assert receive_ready(other_channel, other.channel) == []  # the other decoder is told nothing
    assert (h.decode_transfer.imm_counted(999),
            h.decode_transfer.imm_counted(1000)) == split_writes(10)


def test_a_prefiller_short_of_pages_never_frees_pages_it_is_still_sending(
        make_harness: MakeHarness) -> None:
    """Four 30-token prompts at once into a prefiller of 20 pages (each needs 8), prefilled
    side by side (a budget of four chunks): it used to preempt a request whose pages had
    writes posted, reuse those pages and rewrite them, so the decoder's counter fired early
    (a checksum failure and a retry). Now requests wait for pages instead: no retry, and
    every request decodes the single-node tokens."""
    h = make_harness(prefill_num_pages=20, prefill_budget=20)
    prompts = [random_prompt(30, seed=40 + i) for i in range(4)]
    requests = [h.submit(p, f"r{i}") for i, p in enumerate(prompts)]
    h.run_until(lambda: all(r.is_finished for r in requests) and h.idle(), timeout_s=20)
    assert [o.cause for o in h.outcomes] == [None] * 4  # each released once, never retried
    assert [r.output_token_ids for r in requests] == [single_node_tokens(p) for p in prompts]
    h.check_clean()


def test_a_transfer_stopped_twice_before_a_poll_ends_once(make_harness: MakeHarness) -> None:
    """A Cancel and the loss of its decoder in one turn (what a prefiller thawed after a
    SIGSTOP sees): the transfer was queued to end twice and poll crashed the node on the second
    (KeyError). Now it ends once, as failed, and nothing is left."""
    h = make_harness()
    h.submit(random_prompt(13, seed=4))
    h.run_until(lambda: h.prefill.num_in_flight == 1)
    assert h.peer is not None
    h.prefill.cancel(h.peer, "r0")
    h.prefill.fail_peer(h.peer, "test: the decoder is gone")
    ended = h.prefill.poll()
    assert [t.request_id for t in ended] == ["r0"]
    assert h.prefill.poll() == [] and h.prefill.num_in_flight == 0
    assert ended[0].cause is FailureCause.CANCELLED  # the first stop is the cause
