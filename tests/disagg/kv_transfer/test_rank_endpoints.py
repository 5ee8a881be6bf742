"""A write into decoder rank r's KV lands on one of decoder rank r's own endpoints (S5b, S6a),
whatever domain count the prefiller has. Both sides are TP 2 over the loopback fabric, one
process each side running the model over every rank's shard."""

from __future__ import annotations

import pytest

from disagg.kv_transfer.transfer_plan import num_pages, rank_descriptors
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import random_prompt, single_node_tokens
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric


@pytest.mark.parametrize(("prefill_domains", "decode_domains"), [(1, 2), (2, 1)])
def test_each_ranks_kv_lands_on_that_ranks_endpoints(make_harness: MakeHarness,
                                                     prefill_domains: int,
                                                     decode_domains: int) -> None:
    """Decoder rank r's immediates all arrive on rank r's domains: its KV came in through its
    own NICs. (Matched by domain index, prefiller rank 1's one domain, index 1, would hit
    decoder rank 0's second NIC; with 2 per prefiller rank, rank 0's index 1 would hit rank 1.)"""
    h = make_harness(prefill_tp=2, decode_tp=2, prefill_domains_per_rank=prefill_domains,
                     decode_domains_per_rank=decode_domains)
    prompt = random_prompt(19)
    request = h.submit(prompt)
    h.run_to_end(request)
    assert request.output_token_ids == single_node_tokens(prompt)
    kv_writes = num_pages(len(prompt) - 1, 4) * h.decode_parts.model.config.num_layers
    imms = [stats.imms_received for stats in h.decode_transfer.stats()]
    per_rank = [sum(imms[r * decode_domains:(r + 1) * decode_domains]) for r in range(2)]
    context_writes = 1  # to the context region, at every endpoint: one of them
    assert sum(per_rank) == 2 * kv_writes + context_writes
    assert sorted(per_rank) == [kv_writes, kv_writes + context_writes], imms
    h.check_clean()


def test_rank_descriptors_name_only_each_ranks_domains() -> None:
    """Rank r's descriptor keeps its own (endpoint, key) pairs, in order; None keeps all."""
    with LoopbackEngine(fabric=LoopbackFabric(), num_domains=4) as engine:
        _, first = engine.register_memory(bytearray(64), "kv0")
        _, second = engine.register_memory(bytearray(64), "kv1")
        ours = rank_descriptors([first, second], [(0, 1), (2, 3)])
        assert [d.domains for d in ours] == [first.domains[:2], second.domains[2:]]
        assert rank_descriptors([first, second], None) == [first, second]
        with pytest.raises(ValueError, match="not domains of region 'kv1'"):
            rank_descriptors([first, second], [(0,), (4,)])
