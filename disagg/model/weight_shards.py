"""The weights one tensor-parallel rank holds, and every parameter's full shape (S3c, S6).

Both come from the model itself: a `Transformer` built on the meta device (no memory, no
values) lists its parameters, and each module says which slice of a full weight a rank keeps
(`tp_cuts`). So the names the loaders check, the random presets and the per-rank shards cannot
drift from the modules that use them.
"""

from __future__ import annotations

import torch

from disagg.model.tensor_parallel import Cut, TPShard
from disagg.model.transformer import Transformer
from disagg.model_config import ModelConfig


def _meta_model(config: ModelConfig, shard: TPShard | None = None) -> Transformer:
    with torch.device("meta"):
        return Transformer(config, shard=shard)


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> full (unsharded) shape of every parameter, in the model's own order, weights as
    ``[out_features, in_features]``: Hugging Face's names without ``model.``.

    >>> shapes = parameter_shapes(ModelConfig.from_name("tiny"))
    >>> shapes["layers.0.self_attn.k_proj.weight"]  # [num_kv_heads * head_dim, hidden_size]
    (32, 64)
    """
    return {name: tuple(p.shape) for name, p in _meta_model(config).named_parameters()}


def rank_cuts(config: ModelConfig, shard: TPShard) -> dict[str, Cut]:
    """Parameter name -> the slice rank `shard.rank` holds, for every weight TP splits."""
    if shard.size == 1:
        return {}
    return _meta_model(config, TPShard(shard.rank, shard.sharding)).tp_cuts()


def shard_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig,
                     shard: TPShard) -> dict[str, torch.Tensor]:
    """The weights rank `shard.rank` holds (names as in `Transformer.load_weights`)."""
    cuts = rank_cuts(config, shard)
    return {name: cuts[name].apply(t) if name in cuts else t for name, t in state_dict.items()}
