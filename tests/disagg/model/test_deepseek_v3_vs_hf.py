"""Greedy tokens of our paged engine equal transformers' on tiny random DeepSeek-V3 models.

The reference is `transformers.DeepseekV3ForCausalLM` built here, saved with `save_pretrained`
and read back as our checkpoint would be (safetensors, ``model.`` stripped). With every layer
dense (`first_k_dense_replace = num_hidden_layers`) this checks MLA over the paged latent cache
end to end: both KV layouts, queries with and without the low-rank path, and a batch of
prompts under chunked prefill whose decodes run as one padded batch (the absorbed form), also
through the static buffers that CUDA graphs replay. The MoE variant makes layer 1 sparse
(sigmoid routing over expert groups with a random correction bias, one shared expert).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model_config import MLAConfig, MoEConfig

transformers = pytest.importorskip("transformers")

NUM_LAYERS, NUM_NEW_TOKENS = 2, 16
HFModel = tuple[object, ModelConfig, dict[str, torch.Tensor]]
GetModel = Callable[..., HFModel]


def make_hf_deepseek(tmp_path: Path, q_lora_rank: int | None, first_dense: int = NUM_LAYERS,
                     seed: int = 0) -> HFModel:
    """A random DeepSeek-V3 whose first `first_dense` layers are dense (the rest MoE), our
    `ModelConfig` and its saved weights in our names."""
    torch.manual_seed(seed)
    hf_config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=first_dense, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
        attn_implementation="eager")
    hf_model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the choice, not the weight
                buffer.uniform_(-0.3, 0.3)
    hf_model.save_pretrained(tmp_path / "deepseek")
    saved = safetensors.torch.load_file(tmp_path / "deepseek" / "model.safetensors")
    state_dict = {name.removeprefix("model."): tensor for name, tensor in saved.items()}
    mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                    q_lora_rank=q_lora_rank)
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    routing="sigmoid_grouped", num_shared_experts=1, n_group=2, topk_group=1,
                    routed_scaling_factor=hf_config.routed_scaling_factor,
                    first_dense_layers=first_dense)
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=1,
                         head_dim=mla.latent_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=512, architecture="deepseek_v3", mla=mla,
                         moe=moe)
    return hf_model, config, state_dict


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> GetModel:
    """`deepseek(q_lora_rank, first_dense)`: `make_hf_deepseek`'s model, built once per module."""
    models: dict[tuple[int | None, int], HFModel] = {}

    def get(q_lora_rank: int | None, first_dense: int = NUM_LAYERS) -> HFModel:
        key = (q_lora_rank, first_dense)
        if key not in models:
            models[key] = make_hf_deepseek(tmp_path_factory.mktemp("deepseek"), *key)
        return models[key]

    return get


def hf_greedy(hf_model: object, prompt: list[int]) -> list[int]:
    """Greedy continuation by transformers' own cached generation loop."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def our_greedy(config: ModelConfig, state_dict: dict[str, torch.Tensor],
               prompts: list[list[int]], kv_layout: str, page_size: int,
               chunk_size: int, cuda_graph: bool = False) -> list[list[int]]:
    engine_config = EngineConfig(
        config, CacheConfig(page_size=page_size, num_pages=2048 // page_size, kv_layout=kv_layout),
        SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=max(chunk_size, 64)),
        cuda_graph=cuda_graph)
    engine = build_engine(engine_config, state_dict)
    requests = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS,
                                                       ignore_eos=True))
    engine.allocator.check_invariants(expect_all_free=True)
    if cuda_graph:  # the decodes ran through the static buffers a CUDA graph replays
        assert engine.runner.graph_stats["static"] > 0
    return [request.output_token_ids for request in requests]


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora", "q-proj"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_dense_deepseek_v3_matches_hf(deepseek: GetModel, q_lora_rank: int | None,
                                      kv_layout: str) -> None:
    """One prompt, each layout, with and without the low-rank query, decodes HF's tokens."""
    hf_model, config, state_dict = deepseek(q_lora_rank)
    prompt = random_prompts([19])[0]
    ours = our_greedy(config, state_dict, [prompt], kv_layout, page_size=16, chunk_size=512)
    assert ours == [hf_greedy(hf_model, prompt)]


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_moe_deepseek_v3_matches_hf(deepseek: GetModel, kv_layout: str) -> None:
    """A dense layer, then a sparse one (routed and shared experts): HF's tokens."""
    hf_model, config, state_dict = deepseek(24, first_dense=1)
    assert config.moe is not None and config.moe.is_sparse(1)
    assert "layers.1.mlp.experts.3.down_proj.weight" in state_dict
    prompt = random_prompts([19])[0]
    ours = our_greedy(config, state_dict, [prompt], kv_layout, page_size=16, chunk_size=512)
    assert ours == [hf_greedy(hf_model, prompt)]


@pytest.mark.parametrize(("first_dense", "cuda_graph"),
                         [(NUM_LAYERS, False), (NUM_LAYERS, True), (1, False)],
                         ids=["dense-eager", "dense-static-decode", "moe-eager"])
def test_batched_chunked_deepseek_v3_matches_hf(deepseek: GetModel, first_dense: int,
                                                cuda_graph: bool) -> None:
    """Concurrent prompts, chunks splitting odd pages, batched decodes (eager, or through the
    padded static buffers of the decode graphs): HF's tokens for each prompt."""
    hf_model, config, state_dict = deepseek(24, first_dense)
    prompts = random_prompts([1, 9, 17, 6])
    ours = our_greedy(config, state_dict, prompts, "HND", page_size=3, chunk_size=5,
                      cuda_graph=cuda_graph)
    assert ours == [hf_greedy(hf_model, prompt) for prompt in prompts]
