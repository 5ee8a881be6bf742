"""One MLA layer (`latent_attention.py`) against transformers' `DeepseekV3Attention`.

The reference is the transformers module with our weights copied in, run over the whole
sequence at once; ours prefills through the paged latent cache and then decodes token by
token, both KV layouts, several page sizes, one request alone and a padded decode batch, with
biases and with DeepSeek's yarn. Also: decodes take the absorbed form, which agrees with the
up-projected one on the same cache; the cache holds transformers' own latent rows; TP ranks'
outputs sum to TP 1 and their latent rows are bit-identical.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from disagg.config import CacheConfig
from disagg.model import latent_paged_attention
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.kv_cache import PagedKVCache
from disagg.model.latent_attention import LatentAttention, softmax_scale
from disagg.model.latent_paged_attention import absorbed_attention, upprojected_attention
from disagg.model.rope import RotaryEmbedding
from disagg.model.sharding import Sharding
from disagg.model.tensor_parallel import TPShard
from disagg.model_config import MLAConfig, ModelConfig, RopeScaling

transformers = pytest.importorskip("transformers")
hf_deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

HIDDEN, HEADS, RANK, NOPE, ROPE, V = 32, 4, 16, 8, 4, 6
ATOL = 1e-5


def hf_mla_config(q_lora_rank: int | None, **overrides: object) -> object:
    """A tiny DeepSeek-V3 config: v_head_dim differs from qk_nope_head_dim on purpose."""
    fields: dict[str, object] = dict(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
        kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
        max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.3,
        attn_implementation="eager")
    return transformers.DeepseekV3Config(**(fields | overrides))


def model_config(hf_config: object) -> ModelConfig:
    """Our `ModelConfig` for a transformers DeepSeek-V3 config (dense feed-forward)."""
    mla = MLAConfig(kv_lora_rank=hf_config.kv_lora_rank,
                    qk_nope_head_dim=hf_config.qk_nope_head_dim,
                    qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim,
                    q_lora_rank=hf_config.q_lora_rank, rope_interleave=hf_config.rope_interleave)
    return ModelConfig(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads, num_kv_heads=1, head_dim=mla.latent_dim,
        rms_norm_eps=hf_config.rms_norm_eps, rope_theta=hf_config.rope_parameters["rope_theta"],
        max_position_embeddings=hf_config.max_position_embeddings,
        attention_bias=hf_config.attention_bias, o_proj_bias=hf_config.attention_bias,
        architecture="deepseek_v3", mla=mla)


def make_pair(q_lora_rank: int | None = 12, seed: int = 0, **overrides: object
              ) -> tuple[object, LatentAttention, ModelConfig]:
    """transformers' layer (random weights, norms too) and ours holding the same weights."""
    torch.manual_seed(seed)
    hf_config = hf_mla_config(q_lora_rank, **overrides)
    hf = hf_deepseek.DeepseekV3Attention(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            if getattr(hf, name) is not None:
                getattr(hf, name).weight.uniform_(0.5, 1.5)
    config = model_config(hf_config)
    ours = LatentAttention(config, TPShard.single(1))
    ours.load_state_dict(hf.state_dict())
    return hf, ours, config


def hf_forward(hf: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers over the whole sequence ``[num_tokens, hidden]`` (causal): its output and
    the latent rows it cached, ``[num_tokens, kv_lora_rank + qk_rope_head_dim]``."""
    n = x.shape[0]
    rope = hf_deepseek.DeepseekV3RotaryEmbedding(hf.config)
    cos_sin = rope(x[None], torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    cache = transformers.DynamicCache()
    with torch.no_grad():
        out, _ = hf(x[None], cos_sin, mask, cache=cache)
    layer = cache.layers[0]
    return out[0], torch.cat((layer.keys[0, 0], layer.values[0, 0]), dim=-1)


def make_cache(config: ModelConfig, kv_layout: str, page_size: int) -> PagedKVCache:
    return PagedKVCache(config, CacheConfig(page_size=page_size, num_pages=64 // page_size + 8,
                                            kv_layout=kv_layout))


def request_pages(page_size: int, num_tokens: int, first: int = 0) -> torch.Tensor:
    """Pages for one request, in a scrambled order so page order matters."""
    num_pages = -(-num_tokens // page_size)
    return torch.arange(first, first + num_pages).flip(0)


def chunk_meta(page_ids: torch.Tensor, page_size: int, context_len: int,
               query_len: int) -> AttentionMetadata:
    """One request's chunk of `query_len` tokens after `context_len` cached ones."""
    positions = torch.arange(context_len, context_len + query_len)
    return AttentionMetadata(page_ids[positions // page_size], positions % page_size,
                             [SequenceSlice(0, query_len, context_len, page_ids)])


def run_chunk(ours: LatentAttention, config: ModelConfig, cache: PagedKVCache,
              x: torch.Tensor, page_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    meta = chunk_meta(page_ids, cache.page_size, context_len, x.shape[0])
    positions = torch.arange(context_len, context_len + x.shape[0])
    with torch.no_grad():
        angles = RotaryEmbedding.for_model(config).angles(positions, meta, x.dtype)
        return ours(x, angles, cache, 0, meta)


def prefill_then_decode(ours: LatentAttention, config: ModelConfig, cache: PagedKVCache,
                        x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Our outputs for every row of `x`: the first `prompt_len` as one chunk, then one by one."""
    pages = request_pages(cache.page_size, x.shape[0])
    outs = [run_chunk(ours, config, cache, x[:prompt_len], pages, 0)]
    outs += [run_chunk(ours, config, cache, x[t:t + 1], pages, t)
             for t in range(prompt_len, x.shape[0])]
    return torch.cat(outs)


def forbid_upprojection(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on a decode that expands K/V from the latent fails the test: decodes must
    take the absorbed form."""
    def refuse(*_: object) -> torch.Tensor:
        raise AssertionError("a decode up-projected the latent instead of absorbing W_UK/W_UV")
    monkeypatch.setattr(latent_paged_attention, "upprojected_attention", refuse)


def test_decodes_take_the_absorbed_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single request's one-token steps attend over the latent rows (absorbed), and still
    equal transformers."""
    hf, ours, config = make_pair(seed=7)
    x = torch.randn(8, HIDDEN)
    cache = make_cache(config, "NHD", 3)
    pages = request_pages(3, 8)
    outs = [run_chunk(ours, config, cache, x[:5], pages, 0)]
    forbid_upprojection(monkeypatch)
    outs += [run_chunk(ours, config, cache, x[t:t + 1], pages, t) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(outs), hf_forward(hf, x)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["q-lora", "q-proj"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_prefill_and_decode_match_hf(q_lora_rank: int | None, kv_layout: str,
                                     page_size: int) -> None:
    """A prefill, then decode steps through the paged cache, equal transformers' layer."""
    hf, ours, config = make_pair(q_lora_rank)
    x = torch.randn(11, HIDDEN)
    expected, _ = hf_forward(hf, x)
    got = prefill_then_decode(ours, config, make_cache(config, kv_layout, page_size), x, 7)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_chunked_prefill_matches_hf() -> None:
    """Chunks over a cached prefix (the causal mask over prefix + chunk) equal one pass."""
    hf, ours, config = make_pair(seed=1)
    x = torch.randn(13, HIDDEN)
    cache = make_cache(config, "HND", 3)
    pages = request_pages(3, 13)
    got = torch.cat([run_chunk(ours, config, cache, x[a:b], pages, a)
                     for a, b in ((0, 4), (4, 9), (9, 13))])
    torch.testing.assert_close(got, hf_forward(hf, x)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_batched_decode_matches_hf(kv_layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure-decode batch over a padded `decode_page_table` equals transformers per request."""
    hf, ours, config = make_pair(seed=2)
    page_size, lengths = 3, [4, 9, 1]
    cache = make_cache(config, kv_layout, page_size)
    xs = [torch.randn(n + 1, HIDDEN) for n in lengths]
    pages, first = [], 0
    for x, n in zip(xs, lengths, strict=True):
        pages.append(request_pages(page_size, n + 1, first))
        first += len(pages[-1])
        run_chunk(ours, config, cache, x[:n], pages[-1], 0)
    forbid_upprojection(monkeypatch)
    table = torch.zeros(len(lengths), max(len(p) for p in pages), dtype=torch.int64)
    for row, p in enumerate(pages):
        table[row, :len(p)] = p
    positions = torch.tensor(lengths)
    meta = AttentionMetadata(
        torch.stack([p[n // page_size] for p, n in zip(pages, lengths, strict=True)]),
        positions % page_size, [], decode_page_table=table, decode_kv_lens=positions + 1)
    with torch.no_grad():
        x = torch.stack([x[-1] for x in xs])
        got = ours(x, RotaryEmbedding.for_model(config).angles(positions, meta, x.dtype), cache,
                   0, meta)
    expected = torch.stack([hf_forward(hf, x)[0][-1] for x in xs])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_cache_holds_one_latent_row_per_token(kv_layout: str) -> None:
    """The cache is one row of kv_lora_rank + qk_rope_head_dim per token: transformers' own
    normalised latent and rotated RoPE key, nothing per head."""
    hf, ours, config = make_pair(seed=3)
    cache = make_cache(config, kv_layout, 3)
    assert cache.buffer.shape[2:] in ((1, 3, 1, RANK + ROPE), (1, 1, 3, RANK + ROPE))
    x = torch.randn(8, HIDDEN)
    pages = request_pages(3, 8)
    run_chunk(ours, config, cache, x, pages, 0)
    torch.testing.assert_close(cache.gather_latent(0, pages, 8), hf_forward(hf, x)[1],
                               atol=ATOL, rtol=0)


def test_absorbed_equals_upprojected() -> None:
    """Both attention forms give the same output over the same cached latent rows."""
    _, ours, config = make_pair(seed=4)
    cache = make_cache(config, "NHD", 3)
    pages = request_pages(3, 10)
    run_chunk(ours, config, cache, torch.randn(10, HIDDEN), pages, 0)
    latent = cache.gather_latent(0, pages, 10)
    q_nope, q_rope = torch.randn(4, HEADS, NOPE), torch.randn(4, HEADS, ROPE)
    w_uk, w_uv = ours.kv_b_proj.weight.detach().view(HEADS, -1, RANK).split([NOPE, V], dim=1)
    up = upprojected_attention(q_nope, q_rope, latent, w_uk, w_uv, 6, ours.scale)
    causal = torch.arange(10)[None, :] <= torch.arange(6, 10)[:, None]  # [query, key]
    absorbed = absorbed_attention(q_nope[None], q_rope[None], latent[None], w_uk, w_uv,
                                  causal[None, None], ours.scale)[0]
    torch.testing.assert_close(absorbed, up, atol=1e-5, rtol=1e-5)


def test_attention_bias_matches_hf() -> None:
    """attention_bias puts biases where DeepSeek does (q_a_proj, kv_a_proj_with_mqa, o_proj)."""
    hf, ours, config = make_pair(seed=5, attention_bias=True)
    assert ours.o_proj.bias is not None
    x = torch.randn(6, HIDDEN)
    got = prefill_then_decode(ours, config, make_cache(config, "NHD", 3), x, 4)
    torch.testing.assert_close(got, hf_forward(hf, x)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["q-lora", "q-proj"])
def test_tp2_ranks_sum_to_tp1_with_identical_latents(q_lora_rank: int | None) -> None:
    """TP 2 (identity all-reduce): the ranks' outputs sum to TP 1's and their caches hold
    bit-identical latent rows (the replicated latent cache of S9a). Each rank adds o_proj's
    bias after its (here identity) all-reduce, so the sum holds it twice."""
    _, whole, config = make_pair(q_lora_rank, seed=6, attention_bias=True)
    full = whole.state_dict()
    x = torch.randn(9, HIDDEN)
    expected = prefill_then_decode(whole, config, make_cache(config, "NHD", 3), x, 5)
    outs, caches = [], []
    for rank in range(2):
        part = LatentAttention(config, TPShard(rank, Sharding(2, 1)))
        cuts = part.tp_cuts()
        part.load_state_dict({name: cuts[name].apply(t) if name in cuts else t
                              for name, t in full.items()})
        caches.append(make_cache(config, "NHD", 3))
        outs.append(prefill_then_decode(part, config, caches[-1], x, 5))
    torch.testing.assert_close(outs[0] + outs[1], expected + full["o_proj.bias"], atol=ATOL,
                               rtol=0)
    assert torch.equal(caches[0].buffer, caches[1].buffer)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0}


def test_yarn_layer_matches_hf() -> None:
    """DeepSeek's yarn (cos/sin scaled by the mscale ratio, the softmax by mscale_all_dim's
    temperature squared) past the original length: prefill and decodes equal transformers."""
    hf, ours, config = make_pair(seed=8, rope_parameters=YARN)
    scaling = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                          mscale_all_dim=0.8)
    config = replace(config, rope_scaling=scaling)
    yarn_ours = LatentAttention(config, TPShard.single(1))
    yarn_ours.load_state_dict(ours.state_dict())
    x = torch.randn(24, HIDDEN)
    got = prefill_then_decode(yarn_ours, config, make_cache(config, "HND", 3), x, 20)
    torch.testing.assert_close(got, hf_forward(hf, x)[0], atol=ATOL, rtol=0)


def test_yarn_softmax_scale_matches_hf() -> None:
    """With yarn's mscale_all_dim the softmax scale is transformers' (temperature squared)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 32, "beta_fast": 32.0,
            "beta_slow": 1.0}
    hf = hf_deepseek.DeepseekV3Attention(hf_mla_config(12, rope_parameters=rope), layer_idx=0)
    scaling = RopeScaling("yarn", factor=40.0, original_max_position_embeddings=32,
                          mscale=1.0, mscale_all_dim=0.707)
    config = replace(model_config(hf_mla_config(12)), rope_scaling=scaling)
    assert LatentAttention(config, TPShard.single(1)).scale == pytest.approx(hf.scaling)
    assert softmax_scale(NOPE + ROPE, None) == pytest.approx((NOPE + ROPE) ** -0.5)
