"""A decode step's layers in one C call (`disagg.model.decode_layers`, X8e): the same hidden
state and the same cache, bit for bit, as the PyTorch loop it replaces, in both layouts and
dtypes, for one decode and a padded batch of several, with Qwen2's biases, Qwen3's Q/K norms and
Qwen3-MoE's experts too; it runs only where every layer fits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from disagg.config import PRESETS, CacheConfig
from disagg.errors import KernelError
from disagg.model import decode_layers
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.cpu_kernels import AVX512
from disagg.model.kv_cache import PagedKVCache
from disagg.model.layer_counter import LayerCounter
from disagg.model.precision import cast_model
from disagg.model.sharding import Sharding
from disagg.model.tensor_parallel import TPShard
from disagg.model.transformer import Transformer
from disagg.model_config import ModelConfig
from tests.disagg.model.counting_lib import CountingLib

needs_kernel = pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernels are not built)")
# The kernels split their work over torch's threads: the call and the loop with several.
pytestmark = pytest.mark.usefixtures("several_threads")
PAGE = 4


def _more_sequences(count: int) -> list[tuple[int, list[int]]]:
    """`count` ragged sequences on pages of their own, three each from page 8 on (the longest
    holds 10 + 1 tokens)."""
    more = []
    for row in range(count):
        cached, first = ((row + 3) * 5) % 11, 8 + 3 * row
        more.append((cached, list(range(first, first + cached // PAGE + 1))))
    return more


# (tokens already cached, pages holding them and the new one): ragged on purpose. Then 17
# more, for a batch beyond the kernels' register tile (8 rows).
SEQUENCES = [(6, [3, 0]), (1, [5]), (9, [1, 7, 2]), *_more_sequences(17)]
TOKENS = [5 + 13 * row for row in range(len(SEQUENCES))]


def _model(config: ModelConfig, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():  # norms of one would hide a swapped norm weight
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # a router: built empty, as loading fills it
                parameter.normal_(0.0, 0.5)
    return cast_model(model, dtype)


def _decodes(count: int, padded: bool) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of one decode for each of the first `count` sequences."""
    sequences, slot_pages, slot_offsets = [], [], []
    for row, (cached, pages) in enumerate(SEQUENCES[:count]):
        sequences.append(SequenceSlice(row, 1, cached, torch.tensor(pages)))
        slot_pages.append(pages[cached // PAGE])
        slot_offsets.append(cached % PAGE)
    meta = AttentionMetadata(torch.tensor(slot_pages), torch.tensor(slot_offsets), sequences)
    if padded:
        width = max(len(pages) for _, pages in SEQUENCES[:count])
        meta.decode_page_table = torch.tensor([pages + [0] * (width - len(pages))
                                               for _, pages in SEQUENCES[:count]])
        meta.decode_kv_lens = torch.tensor([cached + 1 for cached, _ in SEQUENCES[:count]])
    return torch.tensor([cached for cached, _ in SEQUENCES[:count]]), meta


def _forward(model: Transformer, cache: PagedKVCache, count: int, padded: bool,
             in_c: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(decode_layers, "ENABLED", in_c)
    positions, meta = _decodes(count, padded)
    with torch.inference_mode():
        return model(torch.tensor(TOKENS[:count]), positions, cache, meta)


def _cache(config: ModelConfig, dtype: torch.dtype, layout: str) -> PagedKVCache:
    cache = PagedKVCache(config, CacheConfig(page_size=PAGE, num_pages=64, kv_layout=layout,
                                             dtype=dtype))
    torch.manual_seed(1)
    cache.buffer.copy_(torch.randn(cache.buffer.shape))  # the sequences' earlier tokens
    return cache


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("count", "padded"), [(1, False), (3, True), (20, True)])
def test_the_call_leaves_the_loops_hidden_state_and_cache(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, layout: str, count: int,
        padded: bool) -> None:
    config = PRESETS["tiny"]
    model = _model(config, dtype)
    in_loop, in_c = _cache(config, dtype, layout), _cache(config, dtype, layout)
    expected = _forward(model, in_loop, count, padded, False, monkeypatch)
    counting = CountingLib(decode_layers.lib, "dl_decode_layers", slice(5, 6))  # rows
    monkeypatch.setattr(decode_layers, "lib", counting)
    got = _forward(model, in_c, count, padded, True, monkeypatch)
    assert counting.calls == [(count,)]  # the layers ran in C, in one call
    assert torch.equal(got, expected)
    assert torch.equal(in_c.buffer, in_loop.buffer)  # every layer's K/V where the loop puts it


# Qwen2's Q/K/V biases with an o_proj bias beside them (Llama's and Qwen3's attention_bias),
# and Qwen3's RMSNorm over each query and key head.
VARIANTS = {"biases": {"attention_bias": True, "o_proj_bias": True}, "qk norm": {"qk_norm": True}}
# Qwen3-MoE with its second of three layers dense (`mlp_only_layers`), and 8 experts for the
# batch's 3 tokens' 3 picks each: some experts get two or three tokens, some none, and a
# token's three weighted outputs add up in expert order (with two, either order is exact).
EXPERTS = replace(PRESETS["tiny-qwen3-moe"], num_layers=3,
                  moe=replace(PRESETS["tiny-qwen3-moe"].moe, mlp_only_layers=(1,),
                              num_experts_per_tok=3))
MOE_VARIANTS = {"experts": EXPERTS,
                "experts, weights as routed": replace(EXPERTS, moe=replace(
                    EXPERTS.moe, norm_topk_prob=False))}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [*sorted(VARIANTS), *MOE_VARIANTS])
def test_the_architectures_variants_leave_the_loops_bits(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, variant: str) -> None:
    config = MOE_VARIANTS.get(variant) or replace(PRESETS["tiny"], **VARIANTS[variant])
    model = _model(config, dtype)
    assert model.layers_in_c
    in_loop, in_c = _cache(config, dtype, "HND"), _cache(config, dtype, "HND")
    expected = _forward(model, in_loop, 3, True, False, monkeypatch)
    counting = CountingLib(decode_layers.lib, "dl_decode_layers", slice(5, 6))
    monkeypatch.setattr(decode_layers, "lib", counting)
    got = _forward(model, in_c, 3, True, True, monkeypatch)
    assert counting.calls == [(3,)]
    assert torch.equal(got, expected)
    assert torch.equal(in_c.buffer, in_loop.buffer)


@needs_kernel
def test_an_early_exit_draft_runs_only_its_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    config = replace(PRESETS["tiny"], num_layers=3)
    model = _model(config, torch.float32)
    caches = [_cache(config, torch.float32, "NHD") for _ in range(2)]
    outputs = []
    for cache, in_c in zip(caches, (False, True), strict=True):
        monkeypatch.setattr(decode_layers, "ENABLED", in_c)
        positions, meta = _decodes(1, False)
        with torch.inference_mode():
            outputs.append(model(torch.tensor([5]), positions, cache, meta, num_layers=2))
    assert torch.equal(outputs[1], outputs[0])
    assert torch.equal(caches[1].buffer, caches[0].buffer)  # layer 3's pages untouched


@needs_kernel
def test_prefill_rows_and_gradients_run_the_loop() -> None:
    config = PRESETS["tiny"]
    model = _model(config, torch.float32)
    cache = _cache(config, torch.float32, "NHD")
    h = torch.zeros(2, config.hidden_size)
    angles = model.rope.angles(torch.tensor([0, 1]), None, h.dtype)  # type: ignore[arg-type]
    chunk = AttentionMetadata(torch.tensor([0, 0]), torch.tensor([0, 1]),
                              [SequenceSlice(0, 2, 0, torch.tensor([0]))])
    with torch.inference_mode():
        assert not decode_layers.takes(model, h, angles, cache, chunk)
    _, one = _decodes(1, False)
    with torch.inference_mode():
        assert decode_layers.takes(model, h[:1], angles, cache, one)
    assert not decode_layers.takes(model, h[:1], angles, cache, one)  # autograd on


@pytest.mark.parametrize("case", ["shared experts", "latent", "tensor parallel"])
def test_layers_it_cannot_run_keep_the_loop(case: str) -> None:
    config = PRESETS["tiny"]
    shard = None
    if case == "shared experts":
        config = replace(EXPERTS, moe=replace(EXPERTS.moe, num_shared_experts=1))
    elif case == "latent":
        config = PRESETS["tiny-mla-moe"]
    else:
        shard = TPShard(0, Sharding(2, config.num_kv_heads))
    assert not Transformer(config, shard=shard).layers_in_c
    assert Transformer(PRESETS["tiny"]).layers_in_c


@needs_kernel
def test_a_layer_counter_to_bump_keeps_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefiller's model bumps its counter after each layer (S3b): never in one call."""
    config = PRESETS["tiny"]
    model = Transformer(config, layer_counter=LayerCounter(torch.zeros(1, dtype=torch.int64)))
    cache = _cache(config, torch.float32, "NHD")
    counting = CountingLib(decode_layers.lib, "dl_decode_layers", slice(5, 6))
    monkeypatch.setattr(decode_layers, "lib", counting)
    _forward(model.eval(), cache, 1, False, True, monkeypatch)
    assert counting.calls == []
    assert int(model.layer_counter.value) == config.num_layers


@needs_kernel
def test_a_slot_outside_the_cache_is_refused_before_any_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose last row's new K/V has no page: the call names it and writes no row."""
    config = PRESETS["tiny"]
    model = _model(config, torch.float32)
    cache = _cache(config, torch.float32, "NHD")
    before = cache.buffer.clone()
    monkeypatch.setattr(decode_layers, "ENABLED", True)
    positions, meta = _decodes(3, True)
    meta.slot_page_ids[2] = cache.num_pages
    with torch.inference_mode(), pytest.raises(KernelError, match="page id or slot"):
        model(torch.tensor([5, 17, 42]), positions, cache, meta)
    assert torch.equal(cache.buffer, before)


@needs_kernel
def test_what_the_call_could_not_index_keeps_the_loop() -> None:
    """No layers to run, more layers than the model or the cache has, several rows without
    the batch's page table: the loop's (it raises where it must; C would read out of bounds)."""
    config = PRESETS["tiny"]
    model = _model(config, torch.float32)
    cache = _cache(config, torch.float32, "NHD")
    short = PagedKVCache(replace(config, num_layers=1), CacheConfig(page_size=PAGE, num_pages=8))
    h = torch.zeros(3, config.hidden_size)
    angles = model.rope.angles(torch.tensor([6, 1, 9]), None, h.dtype)  # type: ignore[arg-type]
    _, padded = _decodes(3, True)
    _, unpadded = _decodes(3, False)
    with torch.inference_mode():
        assert decode_layers.takes(model, h, angles, cache, padded)
        assert decode_layers.takes(model, h, angles, cache, padded, num_layers=1)
        assert not decode_layers.takes(model, h, angles, cache, padded, num_layers=0)
        assert not decode_layers.takes(model, h, angles, cache, padded, num_layers=3)
        assert not decode_layers.takes(model, h, angles, short, padded)
        assert decode_layers.takes(model, h, angles, short, padded, num_layers=1)
        assert not decode_layers.takes(model, h, angles, cache, unpadded)
