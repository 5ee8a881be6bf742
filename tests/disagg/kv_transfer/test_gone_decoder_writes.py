"""A gone decoder's writes still queued at the prefiller are given up at once (X4), unless that
decoder has shaken hands again meanwhile, over the loopback fabric.

Why: a dead decoder's writes never complete on tcp;ofi_rxm (-FI_EAGAIN until their deadline,
`tests/transfer_core/test_stuck_peers.py`), so its requests lingered in flight past a node's
wind-down ("transfers still in flight"). The loopback's parked writes (`hold()`) stand in for
writes the fabric holds.
"""

from __future__ import annotations

from disagg.engine.request import FailureCause, RequestState
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import random_prompt


def test_a_gone_decoders_parked_writes_are_given_up_and_its_request_ends_now(
        make_harness: MakeHarness) -> None:
    """Writes parked in flight, then the decoder is declared gone: they are failed (none
    lands), and the request ends as DECODER_GONE with its pages freed, with no release."""
    h = make_harness()
    h.submit(random_prompt(13, seed=3))
    imm = h.decode.pending["r0"].imm
    h.prefill_transfer.hold()
    h.run_until(lambda: h.prefill_transfer.held_writes() > 0)
    assert h.peer is not None
    h.prefill.fail_peer(h.peer, "decoder gone: test")
    h.run_until(lambda: h.prefill.num_in_flight == 0 and not h.prefill_engine.has_unfinished())
    assert h.prefill_transfer.held_writes() == 0
    (ended,) = h.prefill.recent
    assert (ended.request.state, ended.cause) == (RequestState.FINISHED_FAILED,
                                                  FailureCause.DECODER_GONE)
    assert h.prefill_parts.allocator.num_free == h.free_pages[0]
    assert h.decode_transfer.imm_counted(imm) == 0


def test_a_decoder_that_shook_hands_again_keeps_what_is_queued_for_it(
        make_harness: MakeHarness) -> None:
    """The same decoder engine shook hands again before its old connection is declared gone
    (what a thawed prefiller sees: the decoder reconnected meanwhile): what is queued to that
    engine may be the new handshake's, so nothing is given up; the old connection's request
    ends once its parked writes complete."""
    h = make_harness()
    h.extra_peer(h.decode.hello())  # a newer handshake from the same engine address
    h.submit(random_prompt(13, seed=3))  # on the old connection
    h.prefill_transfer.hold()
    h.run_until(lambda: h.prefill_transfer.held_writes() > 0)
    parked = h.prefill_transfer.held_writes()
    assert h.peer is not None
    h.prefill.fail_peer(h.peer, "decoder gone: test")
    for _ in range(3):
        h.step_prefiller()
    assert (h.prefill_transfer.held_writes(), h.prefill.num_in_flight) == (parked, 1)
    h.prefill_transfer.release()
    h.run_until(lambda: h.prefill.num_in_flight == 0 and not h.prefill_engine.has_unfinished())
    (ended,) = h.prefill.recent
    assert ended.cause is FailureCause.DECODER_GONE
