"""Greedy tokens of our paged engine equal transformers' on each dense architecture we run.

Random tiny Llama (with llama3, linear, yarn and dynamic RoPE scaling), Qwen2 (Q/K/V biases),
Qwen3 (q/k norms, head_dim != hidden / heads, with and without attention_bias) and Mistral
models are built by transformers in the test; our `ModelConfig` is read from the model's own
config dict (`config_from_hf`), the weights are its state dict in our names. Biases and norm
weights are randomised so that skipping one changes the tokens. The scaled-RoPE models have an
original length of 16 and the prompts reach past it. Each case runs one layout alone and the
other batched (models are built once per case, so the file takes a few seconds).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.hf_config import config_from_hf
from tests.disagg.model.test_transformer_vs_hf import hf_greedy, random_prompts

transformers = pytest.importorskip("transformers")

ORIGINAL = 16
NUM_NEW_TOKENS = 12
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-llama3": ("Llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}}),
    "llama-linear": ("Llama", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-yarn": ("Llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL}}),
    # Dynamic NTK grows from max_position_embeddings itself (16), and serves 4 times that.
    "llama-dynamic": ("Llama", {"max_position_embeddings": ORIGINAL, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 32}),
    "qwen3-bias": ("Qwen3", {"head_dim": 32, "attention_bias": True}),
    "mistral": ("Mistral", {"sliding_window": None}),
}


@cache
def make_hf_model(case: str) -> tuple[Any, ModelConfig, dict[str, torch.Tensor]]:
    """A random transformers model of `case`, our config read from its config dict, and its
    state dict in our names (built once per case)."""
    family, overrides = MODELS[case]
    fields: dict[str, Any] = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "initializer_range": 0.2, "attn_implementation": "eager",
    } | overrides
    torch.manual_seed(0)
    hf_config = getattr(transformers, f"{family}Config")(**fields)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(hf_config).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    config = config_from_hf(hf_config.to_dict(), None, source=case)
    state_dict = {name.removeprefix("model."): tensor
                  for name, tensor in hf_model.state_dict().items()}
    return hf_model, config, state_dict


def our_greedy(config: ModelConfig, state_dict: dict[str, torch.Tensor], prompts: list[list[int]],
               kv_layout: str, page_size: int, chunk_size: int) -> list[list[int]]:
    engine_config = EngineConfig(
        config, CacheConfig(page_size=page_size, num_pages=512 // page_size, kv_layout=kv_layout),
        SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=max(chunk_size, 32)))
    engine = build_engine(engine_config, state_dict)
    requests = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    engine.allocator.check_invariants(expect_all_free=True)
    return [request.output_token_ids for request in requests]


def test_configs_carry_the_variants() -> None:
    """What the comparisons below exercise is on: biases, norms, scaling, head_dim."""
    assert make_hf_model("qwen2")[1].attention_bias
    assert not make_hf_model("qwen2")[1].o_proj_bias
    qwen3 = make_hf_model("qwen3-bias")[1]
    assert (qwen3.qk_norm, qwen3.o_proj_bias, qwen3.head_dim) == (True, True, 32)
    dynamic = make_hf_model("llama-dynamic")[1]
    assert dynamic.rope_scaling is not None
    assert dynamic.max_position_embeddings == 4 * ORIGINAL


def layout(case: str, batched: bool) -> str:
    """Each case's single prompt in one layout, its batch in the other."""
    return ("NHD", "HND")[(list(MODELS).index(case) + batched) % 2]


@pytest.mark.parametrize("case", list(MODELS))
def test_one_prompt_matches_hf(case: str) -> None:
    """One 20-token prompt, prefilled in one chunk, then 12 greedy tokens."""
    hf_model, config, state_dict = make_hf_model(case)
    prompt = random_prompts([20])[0]
    ours = our_greedy(config, state_dict, [prompt], layout(case, False), page_size=16,
                      chunk_size=64)
    assert ours == [hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)]


@pytest.mark.parametrize("case", [case for case in MODELS if case != "llama-dynamic"])
def test_batched_chunked_prefill_matches_hf(case: str) -> None:
    """Concurrent prompts of different lengths in chunks of 5 over pages of 3 match HF one by
    one (dynamic NTK is left out: a chunked prompt past its length rotates by chunk)."""
    hf_model, config, state_dict = make_hf_model(case)
    prompts = random_prompts([1, 9, 19], seed=3)
    ours = our_greedy(config, state_dict, prompts, layout(case, True), page_size=3, chunk_size=5)
    assert ours == [hf_greedy(hf_model, prompt, NUM_NEW_TOKENS) for prompt in prompts]
