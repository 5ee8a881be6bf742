"""The model and its cache in half precision: what `cast_model` casts and keeps, what a bf16
page weighs, and a float32 model over a bf16 cache (S3b, S9a).

The comparisons with transformers in the same dtype are in `test_precision_vs_hf.py`.
"""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine, load_transformer
from disagg.engine.request import SamplingParams
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import load_model
from disagg.model.precision import cast_model
from disagg.model.transformer import Transformer
from tests.disagg.model.test_transformer_vs_hf import random_prompts

# DeepSeek-V3's router: transformers keeps both in float32 (`_keep_in_fp32_modules_strict`).
ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
# A float32 model over a bf16 (or fp16) cache: only K/V (or the latent) are rounded, once per
# value, so the logits move less than a whole half-precision model's. Measured on tiny Llama,
# Qwen3, Qwen3-MoE and DeepSeek-V3 models (6 prompts each): at most 1.8 times the cache
# dtype's epsilon times the largest logit (a whole half-precision model: up to 7).
CACHE_ONLY_EPS = 3.0


def engine_config(config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                  kv_layout: str = "NHD") -> EngineConfig:
    return EngineConfig(config, CacheConfig(page_size=16, num_pages=64, kv_layout=kv_layout,
                                            dtype=kv_dtype),
                        SchedulerConfig(chunk_size=64, max_num_batched_tokens=64), dtype=dtype)


def our_prefill_logits(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                       prompt: list[int], dtype: torch.dtype,
                       kv_dtype: torch.dtype) -> torch.Tensor:
    """``[len(prompt), vocab_size]`` logits of every position of one prefill, in `dtype`."""
    engine = engine_config(config, dtype, kv_dtype)
    model = load_transformer(engine, state_dict).eval()
    cache = PagedKVCache(config, engine.cache)
    positions = torch.arange(len(prompt))
    pages = torch.arange(-(-len(prompt) // cache.page_size))
    meta = AttentionMetadata(slot_page_ids=pages[positions // cache.page_size],
                             slot_offsets=positions % cache.page_size,
                             sequences=[SequenceSlice(0, len(prompt), 0, pages)])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), positions, cache, meta))


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3-moe", "tiny-mla-moe"])
def test_cast_model_casts_every_parameter_but_deepseeks_router(name: str) -> None:
    """Every parameter in bf16 except DeepSeek-V3's router weight and correction bias; a
    Qwen3-MoE router is cast like any weight (transformers casts it too)."""
    config = ModelConfig.from_name(name)
    model = cast_model(Transformer(config), torch.bfloat16)
    routers = {n: p.dtype for n, p in model.named_parameters() if n.endswith(ROUTER)}
    others = {n: p.dtype for n, p in model.named_parameters() if not n.endswith(ROUTER)}
    assert set(others.values()) == {torch.bfloat16}
    if config.moe is None:
        assert not routers
    elif config.architecture == "deepseek_v3":
        assert len(routers) == 2 * (config.num_layers - 1)  # the first layer is dense
        assert set(routers.values()) == {torch.float32}
    else:
        assert set(routers.values()) == {torch.bfloat16}


def test_rope_tables_stay_float32() -> None:
    """RoPE's frequencies and cos/sin tables are not cast: transformers keeps them float32 and
    casts cos/sin where they are applied (rounding the frequencies would move every angle)."""
    model = cast_model(Transformer(ModelConfig.from_name("tiny")), torch.bfloat16)
    buffers = dict(model.rope.named_buffers())
    assert set(buffers) == {"inv_freq", "cos", "sin"}
    assert {b.dtype for b in buffers.values()} == {torch.float32}


def test_engine_runs_in_its_dtype() -> None:
    """`build_engine` at bf16: the model's weights, its cache, and the logits it samples from."""
    loaded = load_model("tiny")
    engine = build_engine(EngineConfig(loaded.config, CacheConfig(dtype=torch.bfloat16),
                                       dtype=torch.bfloat16), loaded.state_dict)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.kv_cache.dtype == torch.bfloat16
    request = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1))
    assert engine.runner.execute(engine.scheduler.schedule()).logits.dtype == torch.bfloat16
    assert request.prompt_token_ids == [5, 6, 7]


@pytest.mark.parametrize("name", ["tiny", "tiny-mla-moe"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float32_model_over_a_half_cache_stays_close(name: str, kv_dtype: torch.dtype) -> None:
    """A float32 model over a bf16/fp16 cache (K/V, or MLA's latent rows, rounded on the way
    in, cast back to float32 when gathered): logits near the float32 model's, but not equal."""
    loaded = load_model(name)
    prompt = random_prompts([24], seed=0)[0]
    full = our_prefill_logits(loaded.config, loaded.state_dict, prompt, torch.float32,
                              torch.float32)
    ours = our_prefill_logits(loaded.config, loaded.state_dict, prompt, torch.float32, kv_dtype)
    assert ours.dtype == torch.float32
    error = float((ours - full).abs().max())
    assert 0 < error <= CACHE_ONLY_EPS * torch.finfo(kv_dtype).eps * float(full.abs().max())


@pytest.mark.parametrize("name", ["tiny", "tiny-mla-moe"])
def test_float32_model_decodes_over_a_bf16_cache(name: str) -> None:
    """Prompts prefilled in chunks, then decoded as one padded batch, all reading a bf16
    cache from a float32 model."""
    loaded = load_model(name)
    config = EngineConfig(loaded.config, CacheConfig(page_size=4, num_pages=64,
                                                     dtype=torch.bfloat16))
    engine = build_engine(config, loaded.state_dict)
    requests = engine.generate(random_prompts([3, 9, 14], seed=2),
                               SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(r.output_token_ids) for r in requests] == [6, 6, 6]
    engine.allocator.check_invariants(expect_all_free=True)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("name", ["tiny", "tiny-mla-moe"])
def test_a_bf16_page_weighs_half(name: str, kv_layout: str) -> None:
    """What every page write moves: a bf16 page (K and V, or the latent rows) is half a
    float32 one, a layer too, and the buffer holds bf16."""
    config = ModelConfig.from_name(name)
    caches = {dtype: PagedKVCache(config, CacheConfig(page_size=16, num_pages=8,
                                                      kv_layout=kv_layout, dtype=dtype))
              for dtype in (torch.float32, torch.bfloat16)}
    full, half = caches[torch.float32], caches[torch.bfloat16]
    assert half.buffer.dtype == torch.bfloat16
    assert full.page_nbytes == 16 * config.kv_values_per_token_layer * 4
    assert half.page_nbytes * 2 == full.page_nbytes
    assert half.layer_nbytes * 2 == full.layer_nbytes
