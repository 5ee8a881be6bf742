"""A TP node's leader: rank 0's shard of the model, its own KV shard, every rank's KV (S3c, S5a).

`start_leader` starts the other ranks (each reads its own slices of the checkpoint while the
leader does), builds the leader's shard (cut from the weights it was given, or read as rank 0's
slices), maps every rank's KV shard and returns what the engine is built from. The leader
alone bumps the layer counter, after each o_proj all-reduce (S3c), and its one transfer engine
registers every rank's region: the other ranks never open libfabric. TP 1 runs no rank process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.model.huge_pages import into_huge_pages
from disagg.model.kv_cache import PagedKVCache
from disagg.model.layer_counter import LayerCounter
from disagg.model.loading.registry import load_model
from disagg.model.precision import cast_model
from disagg.model.sharded_kv_cache import ShardedKVCache, shard_config
from disagg.model.sharding import Sharding
from disagg.model.tensor_parallel import TPShard, check_tp
from disagg.model.transformer import Transformer
from disagg.model.weight_shards import shard_state_dict
from disagg.parallel import group
from disagg.parallel.group import GroupSpec
from disagg.parallel.rank_spec import RankSpec, rank_device
from disagg.parallel.ranks import TPRanks


@dataclass
class TPLeader:
    """What an engine on a sharded node is built from."""

    model: Transformer  # rank 0's shard
    local_cache: PagedKVCache  # rank 0's KV, what its forward reads and writes
    kv_cache: ShardedKVCache  # every rank's KV: what transfers register and read
    ranks: TPRanks | None  # None at TP 1


def start_leader(model_spec: str, config: ModelConfig,
                 state_dict: dict[str, torch.Tensor] | None,
                 cache: CacheConfig, sharding: Sharding, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, threads: int | None = None,
                 node_id: str = "node",
                 layer_counter: LayerCounter | None = None,
                 on_failure: Callable[[BaseException], None] = lambda _: None) -> TPLeader:
    """Start ranks 1..N-1, build rank 0, map every KV shard, join the group. `state_dict`: the
    whole weights if the caller holds them already, else None (rank 0 reads its slices)."""
    check_tp(config, sharding)
    ranks = None
    if sharding.tp > 1:
        spec = RankSpec(model_spec, cache, sharding, 0, GroupSpec("", sharding.tp), "", device,
                        threads, node_id, dtype)
        ranks = TPRanks.start(spec, on_failure)
    try:
        shard = TPShard(0, sharding, group.all_reduce) if ranks else TPShard(0, sharding)
        model = Transformer.holding(config, leader_weights(model_spec, config, state_dict,
                                                           shard), layer_counter, shard)
        model = cast_model(model, dtype).to(rank_device(device, 0)).eval()
        into_huge_pages(model)  # its CPU weights: a decode streams them (X8f)
        shard_model = shard_config(config, sharding)
        local = PagedKVCache(shard_model, cache, rank_device(device, 0))
        shards = [local]
        if ranks is not None:
            ranks.connect()
            shards += [PagedKVCache(shard_model, cache, rank_device(device, r), buffer=b)
                       for r, b in enumerate(ranks.kv_buffers, start=1)]
        kv_cache = ShardedKVCache(config, cache, sharding, shards,
                                  copy_remote=ranks.copy_page if ranks else None)
        return TPLeader(model, local, kv_cache, ranks)
    except BaseException:
        if ranks is not None:
            ranks.stop()
        raise


def leader_weights(model_spec: str, config: ModelConfig,
                   state_dict: dict[str, torch.Tensor] | None,
                   shard: TPShard) -> dict[str, torch.Tensor]:
    """Rank 0's weights: cut from `state_dict` when given whole, else read from `model_spec`,
    only rank 0's slices of each split weight."""
    if state_dict is not None:
        return shard_state_dict(state_dict, config, shard)
    return load_model(model_spec, shard=shard).state_dict
