"""TP ranks hold their CPU weight shards in huge pages too (X8f): what a rank process builds,
and the leader's own shard."""

from __future__ import annotations

from disagg.config import CacheConfig, ModelConfig
from disagg.model.loading.registry import load_model
from disagg.model.sharding import Sharding
from disagg.model.tensor_parallel import TPShard
from disagg.parallel.leader import start_leader
from disagg.parallel.rank_worker import load_rank_model
from tests.disagg.model.test_huge_pages import mapping_of, needs_thp


@needs_thp
def test_a_rank_process_model_is_in_huge_pages() -> None:
    sharding = Sharding(2, ModelConfig.from_name("tiny").num_kv_heads)
    model = load_rank_model("tiny", TPShard(1, sharding), "cpu")
    assert all(mapping_of(p.data_ptr())["asked"] == 1 for p in model.parameters())


@needs_thp
def test_the_leaders_shard_is_in_huge_pages() -> None:
    """At TP 1 the leader builds its shard without starting ranks: the same path as at TP N."""
    loaded = load_model("tiny")
    leader = start_leader("tiny", loaded.config, loaded.state_dict,
                          CacheConfig(page_size=4, num_pages=32),
                          Sharding(1, loaded.config.num_kv_heads))
    assert leader.ranks is None
    assert all(mapping_of(p.data_ptr())["asked"] == 1 for p in leader.model.parameters())
