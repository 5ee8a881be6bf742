"""What a node's builder loads of its model, and the fingerprint it shows peers (S3c, S2).

A TP node's own process never holds the whole model: it loads the config and tokenizer, and
the leader reads rank 0's slices. The fingerprint is the same at every TP degree, differs with
the dtype, and a decoder whose fingerprint differs is refused at handshake, naming "model".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from disagg.config import CacheConfig, ParallelConfig, SchedulerConfig
from disagg.errors import PeerMismatchError
from disagg.model.loading.gguf_cache import CACHE_ENV
from disagg.model.loading.registry import LoadedModel, ModelTokenizer, load_model
from disagg.model.sharding import Sharding
from disagg.model.tensor_parallel import TPShard
from disagg.model.weight_shards import shard_state_dict
from disagg.node import builder
from disagg.node.base import Inbox
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode

MakeCheckpoint = Callable[..., Path]
CACHE = CacheConfig(page_size=4, num_pages=64)


@pytest.fixture(autouse=True)
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # file digests remembered here


def prefiller(model: str, tp: int = 1, dtype: torch.dtype = torch.float32) -> NodeConfig:
    return NodeConfig(model, CACHE, SchedulerConfig(chunk_size=8, max_num_batched_tokens=8,
                                                    mode="prefill_only"),
                      ParallelConfig(tp), role=NodeRole.PREFILL, dtype=dtype)


def decoder(model: str, prefill: str, tp: int = 1, dtype: torch.dtype = torch.float32,
            ) -> NodeConfig:
    return NodeConfig(model, CACHE, SchedulerConfig(chunk_size=8, max_num_batched_tokens=8),
                      ParallelConfig(tp), role=NodeRole.DECODE, node_id="decode-0",
                      prefillers=(prefill,), dtype=dtype)


def test_a_tp_node_process_loads_no_weight(make_hf_llama_checkpoint: MakeCheckpoint,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """At TP 2 the node's own process loads the config and tokenizer only, never
    `load_model` (its leader reads rank 0's slices)."""
    directory = make_hf_llama_checkpoint()

    def whole(*_: object, **__: object) -> None:
        raise AssertionError("the TP node loaded the whole model")

    monkeypatch.setattr(builder, "load_model", whole)
    loaded = builder.node_model(prefiller(str(directory), tp=2))
    assert isinstance(loaded, ModelTokenizer)
    assert loaded.config.hidden_size == 64


def test_a_tp_1_node_loads_every_weight(make_hf_llama_checkpoint: MakeCheckpoint) -> None:
    """At TP 1 the node's process is the model: it loads every weight."""
    loaded = builder.node_model(prefiller(str(make_hf_llama_checkpoint())))
    assert isinstance(loaded, LoadedModel)
    assert "layers.1.mlp.down_proj.weight" in loaded.state_dict


def test_tp_1_and_tp_2_nodes_agree(make_hf_llama_checkpoint: MakeCheckpoint) -> None:
    """A TP 2 prefiller and a TP 1 decoder of one checkpoint show the same fingerprint."""
    model = str(make_hf_llama_checkpoint())
    prefill, decode = prefiller(model, tp=2), decoder(model, "127.0.0.1:1", tp=1)
    assert (builder.node_fingerprint(prefill, builder.node_model(prefill))
            == builder.node_fingerprint(decode, builder.node_model(decode)))


def test_nodes_in_other_dtypes_differ(make_hf_llama_checkpoint: MakeCheckpoint) -> None:
    """The same checkpoint run in bfloat16 and in float32: two fingerprints."""
    model = str(make_hf_llama_checkpoint())
    fp32, bf16 = prefiller(model), prefiller(model, dtype=torch.bfloat16)
    assert (builder.node_fingerprint(fp32, builder.node_model(fp32))
            != builder.node_fingerprint(bf16, builder.node_model(bf16)))


@pytest.mark.fabric
def test_a_decoder_in_another_dtype_is_refused_naming_model() -> None:
    """A bfloat16 decoder (its KV still float32, so only the model differs) shakes hands with
    a float32 prefiller: refused, naming "model"; the prefiller serves on."""
    node = builder.build_node(prefiller("tiny"))
    assert isinstance(node, PrefillNode)
    thread = threading.Thread(target=node.run, daemon=True)
    thread.start()
    try:
        with pytest.raises(PeerMismatchError, match="model: decoder has 'llama-bfloat16-"):
            builder.build_node(decoder("tiny", node.address, dtype=torch.bfloat16))
    finally:
        node.stop()
        thread.join(timeout=10)
        node.close()


@pytest.mark.slow
def test_a_tp_2_leader_holds_rank_0s_slices(make_hf_llama_checkpoint: MakeCheckpoint) -> None:
    """A TP 2 prefiller built from what its process loaded (no weights): the leader's model
    holds exactly rank 0's slices of the checkpoint (a real rank process runs rank 1)."""
    directory = make_hf_llama_checkpoint()
    config = prefiller(str(directory), tp=2)
    parts, _ = builder.prefill_parts(config, builder.node_model(config), Inbox())
    try:
        whole = load_model(str(directory))
        shard = TPShard(0, Sharding.of_model(whole.config, 2))
        expected = shard_state_dict(whole.state_dict, whole.config, shard)
        held = parts.model.state_dict()
        assert all(torch.equal(held[name], tensor) for name, tensor in expected.items())
    finally:
        parts.runner.close()
