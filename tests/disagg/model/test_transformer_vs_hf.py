"""Greedy tokens of our paged engine equal Hugging Face transformers' on random Llama models.

The reference is `transformers.LlamaForCausalLM` built in the test itself: MHA, GQA and MQA
shapes, tied and untied embeddings, both KV layouts, page sizes 1, 16 and odd ones, chunk sizes
that split prompts mid-page, and a batch of concurrent prompts of different lengths.
"""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 24


def make_hf_llama(num_heads: int, num_kv_heads: int, tied: bool, seed: int = 0
                  ) -> tuple[object, ModelConfig, dict[str, torch.Tensor]]:
    """A random HF Llama model, our matching `ModelConfig` and its state dict in our names."""
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, initializer_range=0.2, attn_implementation="eager",
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=64 // num_heads, max_position_embeddings=512,
                         tie_word_embeddings=tied)
    state_dict = {name.removeprefix("model."): tensor
                  for name, tensor in hf_model.state_dict().items()
                  if not (tied and name == "lm_head.weight")}
    return hf_model, config, state_dict


def hf_greedy(hf_model: object, prompt: list[int], num_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers' own cached generation loop."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def our_greedy(config: ModelConfig, state_dict: dict[str, torch.Tensor], prompts: list[list[int]],
               kv_layout: str, page_size: int, chunk_size: int) -> list[list[int]]:
    engine_config = EngineConfig(
        config, CacheConfig(page_size=page_size, num_pages=4096 // page_size, kv_layout=kv_layout),
        SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=max(chunk_size, 64)))
    engine = build_engine(engine_config, state_dict)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    requests = engine.generate(prompts, params)
    engine.allocator.check_invariants(expect_all_free=True)
    return [request.output_token_ids for request in requests]


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tied"),
                         [(4, 4, False), (8, 2, True), (4, 1, False), (8, 4, True)],
                         ids=["mha-untied", "gqa-tied", "mqa-untied", "gqa-untied"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_shapes_and_layouts_match_hf(num_heads: int, num_kv_heads: int, tied: bool,
                                     kv_layout: str) -> None:
    """Each attention shape, tied or not, in each layout, decodes HF's tokens (one prompt)."""
    hf_model, config, state_dict = make_hf_llama(num_heads, num_kv_heads, tied)
    prompt = random_prompts([21])[0]
    ours = our_greedy(config, state_dict, [prompt], kv_layout, page_size=16, chunk_size=512)
    assert ours == [hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)]


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(("page_size", "chunk_size"), [(1, 7), (16, 5), (3, 4), (5, 16), (7, 3)])
def test_batched_chunked_prefill_matches_hf(kv_layout: str, page_size: int,
                                            chunk_size: int) -> None:
    """Concurrent prompts of different lengths, chunks splitting pages, match HF one by one."""
    hf_model, config, state_dict = make_hf_llama(8, 2, tied=False, seed=3)
    prompts = random_prompts([1, 9, 17, 30, 4])
    ours = our_greedy(config, state_dict, prompts, kv_layout, page_size, chunk_size)
    assert ours == [hf_greedy(hf_model, prompt, NUM_NEW_TOKENS) for prompt in prompts]
