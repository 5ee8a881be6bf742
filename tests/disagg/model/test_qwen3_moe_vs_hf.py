"""Greedy tokens of our paged engine equal transformers' on a random Qwen3-MoE model (S9b).

The reference is `transformers.Qwen3MoeForCausalLM`, saved with `save_pretrained` so the
weights we load carry the checkpoint's names (one tensor per expert, q/k norms); both KV
layouts, and one batch of prompts of different lengths with chunks that split pages. Layer 1
is listed in `mlp_only_layers`, so a dense layer follows a sparse one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model_config import MoEConfig

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 16
VOCAB = 256


def make_hf_qwen3_moe(tmp_path: Path, norm_topk_prob: bool, seed: int = 0
                      ) -> tuple[object, ModelConfig, dict[str, torch.Tensor]]:
    """A random HF Qwen3-MoE model, our matching `ModelConfig`, and the state dict its
    `save_pretrained` wrote, read back without ``model.``."""
    torch.manual_seed(seed)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.2, attn_implementation="eager")
    hf_model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path)
    state_dict = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        state_dict |= {name.removeprefix("model."): tensor
                       for name, tensor in safetensors.torch.load_file(file).items()}
    config = ModelConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
        architecture="qwen3_moe", qk_norm=True,
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=norm_topk_prob, mlp_only_layers=(1,)))
    return hf_model, config, state_dict


def hf_greedy(hf_model: object, prompt: list[int]) -> list[int]:
    """Greedy continuation by transformers' own cached generation loop."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def our_greedy(config: ModelConfig, state_dict: dict[str, torch.Tensor], prompts: list[list[int]],
               kv_layout: str, page_size: int, chunk_size: int) -> list[list[int]]:
    engine_config = EngineConfig(
        config, CacheConfig(page_size=page_size, num_pages=2048 // page_size, kv_layout=kv_layout),
        SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=max(chunk_size, 64)))
    engine = build_engine(engine_config, state_dict)
    requests = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS,
                                                       ignore_eos=True))
    engine.allocator.check_invariants(expect_all_free=True)
    return [request.output_token_ids for request in requests]


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def test_checkpoint_names_per_expert(tmp_path: Path) -> None:
    """`save_pretrained` writes each expert apart, and the names are exactly our parameters."""
    from disagg.model.weight_shards import parameter_shapes

    _, config, state_dict = make_hf_qwen3_moe(tmp_path, norm_topk_prob=True)
    assert state_dict["layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert set(state_dict) == set(parameter_shapes(config))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_greedy_matches_hf(tmp_path: Path, kv_layout: str, norm_topk_prob: bool) -> None:
    """One prompt, each KV layout, renormalised top-k or not, decodes HF's tokens."""
    hf_model, config, state_dict = make_hf_qwen3_moe(tmp_path, norm_topk_prob)
    prompt = random_prompts([21])[0]
    ours = our_greedy(config, state_dict, [prompt], kv_layout, page_size=16, chunk_size=512)
    assert ours == [hf_greedy(hf_model, prompt)]


def test_batched_chunked_prefill_matches_hf(tmp_path: Path) -> None:
    """Concurrent prompts of different lengths, chunks splitting pages, match HF one by one."""
    hf_model, config, state_dict = make_hf_qwen3_moe(tmp_path, norm_topk_prob=True, seed=3)
    prompts = random_prompts([1, 9, 17, 30])
    ours = our_greedy(config, state_dict, prompts, "HND", page_size=5, chunk_size=7)
    assert ours == [hf_greedy(hf_model, prompt) for prompt in prompts]
