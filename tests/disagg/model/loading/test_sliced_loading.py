"""One TP rank reads only its slices of a checkpoint, in the dtype asked for
(`disagg.model.loading.safetensors_files`, `load_model(..., shard=)`, the rank worker and the
leader).

The reference is the whole checkpoint cut afterwards (`weight_shards.shard_state_dict`); the
mechanism is checked by counting the elements safetensors hands out: a rank must be given
exactly its shard's, never a full split weight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.model.loading import safetensors_files
from disagg.model.loading.registry import init_random_weights, load_model
from disagg.model.sharding import Sharding
from disagg.model.tensor_parallel import TPShard
from disagg.model.weight_shards import rank_cuts, shard_state_dict
from disagg.parallel.leader import leader_weights
from disagg.parallel.rank_worker import load_rank_model

MakeCheckpoint = Callable[..., Path]


class _CountingSlice:
    def __init__(self, inner: Any, key: str, log: list[tuple[str, int]]) -> None:  # noqa: ANN401
        self._inner, self._key, self._log = inner, key, log

    def get_shape(self) -> list[int]:
        return self._inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:  # noqa: ANN401
        tensor = self._inner[index]
        self._log.append((self._key, tensor.numel()))
        return tensor


class _CountingHandle:
    """A `safe_open` handle that logs (name, elements) of every tensor it materialises."""

    def __init__(self, inner: Any, log: list[tuple[str, int]]) -> None:  # noqa: ANN401
        self._inner, self._log = inner, log

    def __enter__(self) -> _CountingHandle:
        self._inner.__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        self._inner.__exit__(*args)

    def keys(self) -> list[str]:
        return self._inner.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        tensor = self._inner.get_tensor(key)
        self._log.append((key, tensor.numel()))
        return tensor

    def get_slice(self, key: str) -> _CountingSlice:
        return _CountingSlice(self._inner.get_slice(key), key, self._log)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every (checkpoint name, elements) safetensors hands the loader from now on."""
    log: list[tuple[str, int]] = []
    real = safetensors_files.safe_open
    monkeypatch.setattr(safetensors_files, "safe_open",
                        lambda *a, **k: _CountingHandle(real(*a, **k), log))
    return log


def _numel(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in state_dict.values())


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# (query heads, KV heads, TP, rank): GQA split, KV heads replicated on pairs of ranks, MQA.
CASES = [(4, 2, 2, 1), (4, 2, 4, 3), (4, 1, 2, 0)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tp", "rank"), CASES,
                         ids=["gqa-tp2-rank1", "replicated-kv-tp4-rank3", "mqa-tp2-rank0"])
def test_a_rank_reads_only_its_slices(make_hf_llama_checkpoint: MakeCheckpoint,
                                      reads: list[tuple[str, int]], num_heads: int,
                                      num_kv_heads: int, tp: int, rank: int) -> None:
    """The rank's weights equal the whole checkpoint cut, and safetensors handed out exactly
    the shard's elements: no split weight was read whole."""
    directory = make_hf_llama_checkpoint(num_heads, num_kv_heads)
    whole = load_model(str(directory))
    shard = TPShard(rank, Sharding(tp, num_kv_heads))
    reads.clear()
    loaded = load_model(str(directory), shard=shard)
    _assert_same(loaded.state_dict, shard_state_dict(whole.state_dict, whole.config, shard))
    assert sum(n for _, n in reads) == _numel(loaded.state_dict) < _numel(whole.state_dict)
    assert len(reads) == len(loaded.state_dict)  # each tensor read once


def test_a_sharded_checkpoint_is_sliced_too(make_hf_llama_checkpoint: MakeCheckpoint,
                                            reads: list[tuple[str, int]]) -> None:
    """With `model.safetensors.index.json` and several files, each slice comes from its file."""
    directory = make_hf_llama_checkpoint(max_shard_size="40KB")
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    whole = load_model(str(directory))
    shard = TPShard(1, Sharding(2, 2))
    reads.clear()
    loaded = load_model(str(directory), shard=shard)
    _assert_same(loaded.state_dict, shard_state_dict(whole.state_dict, whole.config, shard))
    assert sum(n for _, n in reads) == _numel(loaded.state_dict)


def test_every_split_weight_has_a_cut(make_hf_llama_checkpoint: MakeCheckpoint) -> None:
    """q/k/v/gate/up are cut by rows, o/down by columns; embeddings and norms are whole."""
    config = load_model(str(make_hf_llama_checkpoint())).config
    cuts = rank_cuts(config, TPShard(1, Sharding(2, 2)))
    assert cuts["layers.0.self_attn.q_proj.weight"].dim == 0
    assert cuts["layers.1.mlp.down_proj.weight"].dim == 1
    assert "embed_tokens.weight" not in cuts
    assert "norm.weight" not in cuts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensors_are_cast_as_read(make_hf_llama_checkpoint: MakeCheckpoint,
                                  dtype: torch.dtype) -> None:
    """`dtype` casts every tensor, whole or sliced, to what the fp32 copy casts to."""
    directory = make_hf_llama_checkpoint()
    whole = load_model(str(directory))
    shard = TPShard(0, Sharding(2, 2))
    expected = {n: t.to(dtype) for n, t in shard_state_dict(whole.state_dict, whole.config,
                                                            shard).items()}
    _assert_same(load_model(str(directory), dtype=dtype, shard=shard).state_dict, expected)
    full = load_model(str(directory), dtype=dtype).state_dict
    _assert_same(full, {n: t.to(dtype) for n, t in whole.state_dict.items()})


def test_a_bf16_checkpoint_becomes_fp32_exactly(make_hf_llama_checkpoint: MakeCheckpoint) -> None:
    """The default target is fp32: bf16 slices widen exactly."""
    directory = make_hf_llama_checkpoint()
    weights = load_file(directory / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              directory / "model.safetensors")
    loaded = load_model(str(directory), shard=TPShard(1, Sharding(2, 2)))
    up = loaded.state_dict["layers.1.mlp.up_proj.weight"]
    assert up.dtype == torch.float32
    assert torch.equal(up, weights["model.layers.1.mlp.up_proj.weight"][48:].bfloat16().float())


def test_a_preset_shard_is_generated_whole_then_cut() -> None:
    """Presets have no file to slice: the rank's weights are the random weights cut."""
    loaded = load_model("tiny", shard=TPShard(1, Sharding(2, 2)))
    expected = shard_state_dict(init_random_weights(loaded.config), loaded.config,
                                TPShard(1, Sharding(2, 2)))
    _assert_same(loaded.state_dict, expected)


def test_the_rank_worker_reads_only_its_slices(make_hf_llama_checkpoint: MakeCheckpoint,
                                               reads: list[tuple[str, int]]) -> None:
    """What a rank process builds holds its shard, and it read nothing more."""
    directory = make_hf_llama_checkpoint()
    whole = load_model(str(directory))
    shard = TPShard(1, Sharding(2, 2))
    reads.clear()
    model = load_rank_model(str(directory), shard, "cpu")
    expected = shard_state_dict(whole.state_dict, whole.config, shard)
    _assert_same({n: t for n, t in model.state_dict().items() if n in expected}, expected)
    assert sum(n for _, n in reads) == _numel(expected)


def test_the_leader_reads_only_rank_0s_slices(make_hf_llama_checkpoint: MakeCheckpoint,
                                              reads: list[tuple[str, int]]) -> None:
    """Without whole weights the leader reads rank 0's slices; with them it reads nothing."""
    directory = make_hf_llama_checkpoint()
    whole = load_model(str(directory))
    shard = TPShard(0, Sharding(2, 2))
    expected = shard_state_dict(whole.state_dict, whole.config, shard)
    reads.clear()
    _assert_same(leader_weights(str(directory), whole.config, None, shard), expected)
    assert sum(n for _, n in reads) == _numel(expected)
    reads.clear()
    _assert_same(leader_weights(str(directory), whole.config, whole.state_dict, shard), expected)
    assert reads == []
