"""A forward's requests bound for one decoder share one paged write per layer (S3b, S4c, S6).

Merging is checked two ways: `forward_writes` on hand-made layer writes (grouping by peer and
rank pair, each page tagged with its request's immediate, stopped requests dropped), and three
requests prefilled in one forward through the messengers, where one call per layer must carry
all three requests' pages and each still decodes its own single-node tokens.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from disagg.config import ReliabilityConfig
from disagg.engine.request import FailureCause
from disagg.kv_transfer.forward_writes import forward_writes
from disagg.kv_transfer.layer_writes import LayerWrite
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import random_prompt, single_node_tokens
from transfer_core.transport import PagedWrite

# A stopped request's decoder hears of it and retries quickly, once.
QUICK = ReliabilityConfig(kv_timeout_s=2.0, quarantine_timeout_s=0.5, max_attempts=2)


def _chunk(imm: int, peer: Any, *writes: LayerWrite) -> Any:
    """A request's chunk whose tail immediate is its body's + 100."""
    return SimpleNamespace(outgoing=SimpleNamespace(imm=imm, tail_imm=imm + 100, peer=peer),
                           writes=list(writes))


def _write(dst_rank: int, *offsets: int) -> LayerWrite:
    return LayerWrite(0, dst_rank, 8, None, np.array(offsets), np.array(offsets) + 1000)


def test_requests_merge_per_peer_and_rank_pair() -> None:
    """Two decoders, one of them with two ranks: three merged writes, each page carrying its
    own request's immediate (the tail's in the last layer), in the order the requests came."""
    d0, d1 = SimpleNamespace(peer_id="d0"), SimpleNamespace(peer_id="d1")
    chunks = [_chunk(5, d0, _write(0, 0, 8), _write(1, 16)), _chunk(6, d1, _write(0, 24)),
              _chunk(7, d0, _write(0, 32), _write(1, 40, 48))]
    merged = forward_writes(chunks)
    assert [(m.peer.peer_id, m.shape.dst_rank, m.imms.tolist(), m.src_offsets.tolist())
            for m in merged] == [("d0", 0, [5, 5, 7], [0, 8, 32]),
                                 ("d0", 1, [5, 7, 7], [16, 40, 48]), ("d1", 0, [6], [24])]
    assert merged[0].dst_offsets.tolist() == [1000, 1008, 1032]
    assert merged[0].tail_imms.tolist() == [105, 105, 107]
    assert merged[0].imms_of(2, num_layers=3) is merged[0].tail_imms
    assert merged[0].imms_of(1, num_layers=3) is merged[0].imms


def test_a_stopped_request_drops_out_of_the_merged_write() -> None:
    d0 = SimpleNamespace(peer_id="d0")
    (merged,) = forward_writes([_chunk(5, d0, _write(0, 0)), _chunk(6, d0, _write(0, 8, 16))])
    live = merged.members[1:]
    assert merged.only(merged.members) is merged
    assert (merged.only(live).imms.tolist(), merged.only(live).tail_imms.tolist(),
            merged.only(live).src_offsets.tolist()) == ([6, 6], [106, 106], [8, 16])


def test_one_call_per_layer_carries_every_request_of_a_forward(make_harness: MakeHarness
                                                                 ) -> None:
    """Three 2-token prompts (one prefilled token each) submitted at once are prefilled in
    one forward: a layer's call carries all three requests' pages, and each request decodes
    the single-node tokens."""
    h = make_harness()
    seen: list[int] = []  # distinct immediates per paged-write call
    post = h.prefill_transfer.post_paged_writes

    def spy(write: PagedWrite, *args: Any, **kwargs: Any) -> None:
        values = write.imms if write.imms is not None else [write.imm]
        seen.append(len(set(np.asarray(values).tolist())))
        post(write, *args, **kwargs)

    h.prefill_transfer.post_paged_writes = spy  # type: ignore[method-assign]
    prompts = [random_prompt(2, seed=20 + i) for i in range(3)]
    requests = [h.submit(p, f"r{i}") for i, p in enumerate(prompts)]
    h.run_until(lambda: all(r.is_finished for r in requests) and h.idle())
    assert [r.output_token_ids for r in requests] == [single_node_tokens(p) for p in prompts]
    assert 3 in seen, f"no call carried all three requests: distinct imms per call {seen}"
    h.check_clean()


def test_a_request_stopped_after_planning_drops_out_of_the_merged_calls(
        make_harness: MakeHarness) -> None:
    """Three requests in one forward; the second is stopped as the first layer's merged call
    is about to be posted: no call carries its immediate, the other two share every call and
    decode their single-node tokens, and nothing is left behind."""
    h = make_harness(reliability=QUICK)
    streamer, post_layers = h.prefill.streamer, h.prefill.streamer._post_layers
    stopped: list[int] = []

    def stop_second(merged: Any, layer_zero: Any, group: range) -> None:
        if not stopped and len(merged.members) == 3:
            victim = merged.members[1].outgoing
            victim.stop(FailureCause.CANCELLED, "stopped by the test")
            stopped.extend(victim_imms := (victim.imm, victim.tail_imm))
            assert len(set(victim_imms)) == 2
        post_layers(merged, layer_zero, group)

    seen: list[set[int]] = []
    post = h.prefill_transfer.post_paged_writes

    def spy(write: PagedWrite, *args: Any, **kwargs: Any) -> None:
        values = write.imms if write.imms is not None else [write.imm]
        seen.append(set(np.asarray(values).tolist()))
        post(write, *args, **kwargs)

    streamer._post_layers = stop_second  # type: ignore[method-assign]
    h.prefill_transfer.post_paged_writes = spy  # type: ignore[method-assign]
    prompts = [random_prompt(2, seed=40 + i) for i in range(3)]
    requests = [h.submit(p, f"r{i}") for i, p in enumerate(prompts)]
    h.run_until(lambda: all(r.is_finished for r in requests) and h.idle())
    assert stopped, "the three requests never shared a forward"
    assert all(imm not in s for imm in stopped for s in seen)
    assert sum(len(s) == 2 for s in seen) >= 2  # the two others, every layer
    for i in (0, 2):
        assert requests[i].output_token_ids == single_node_tokens(prompts[i])
    h.check_clean()
