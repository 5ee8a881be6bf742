"""A fork's page copy on a TP node: every rank copies its own shard, sent down its step socket
(`engine/forking.py`, S3c). Each test starts one real rank process."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from disagg.config import CacheConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import load_model
from disagg.model.sharding import Sharding
from disagg.parallel.leader import start_leader
from tests.disagg.parallel.test_ranks import engine_config

pytestmark = pytest.mark.slow  # a rank process: torch starts once more per test


def test_a_page_copy_lands_in_every_ranks_shard() -> None:
    """Page 2, filled through the leader's mapping, is copied into page 5 of both shards:
    rank 0's by the leader, rank 1's by its own process."""
    loaded = load_model("tiny")
    cache = CacheConfig(page_size=3, num_pages=8, kv_layout="HND", prefix_caching=False)
    leader = start_leader("tiny", loaded.config, loaded.state_dict, cache,
                          Sharding(2, loaded.config.num_kv_heads))
    assert leader.ranks is not None
    try:
        shards = leader.kv_cache.shards
        for shard in shards:
            shard.buffer[:, 2].normal_()
        leader.kv_cache.copy_page(2, 5)
        deadline = time.monotonic() + 30
        while not all(torch.equal(s.buffer[:, 5], s.buffer[:, 2]) for s in shards):
            assert time.monotonic() < deadline, "rank 1 never copied its page"
            time.sleep(0.01)
        assert not any(shard.buffer[:, 4].any() for shard in shards)
    finally:
        leader.ranks.stop()


def test_greedy_forks_at_tp2_give_the_unforked_tokens() -> None:
    """n=2 at TP 2: fork 1 decodes on its copy of the last page, which holds the unforked
    request's K/V only if rank 1 copied its heads too."""
    loaded = load_model("tiny")
    engine = build_engine(engine_config(loaded, 2, "NHD"), loaded.state_dict, model_spec="tiny")
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        # 16 tokens: 15 computed by the parent, 3 of them in its last page of 4.
        prompt = [(17 * i + 3) % loaded.config.vocab_size for i in range(16)]
        want = engine.generate([prompt], params)[0].output_token_ids
        forks = engine.generate([prompt], replace(params, n=2))  # the forks, in choice order
        assert [fork.output_token_ids for fork in forks] == [want, want]
        engine.allocator.check_invariants(expect_all_free=True)
    finally:
        engine.close()
