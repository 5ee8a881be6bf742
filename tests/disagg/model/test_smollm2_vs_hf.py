"""SmolLM2-135M end to end: our GGUF loader + paged engine decode transformers' greedy tokens.

The reference is transformers loading the same GGUF file by its own code (dequantize, un-permute
Q/K, its own tokenizer) and running its own generation loop: nothing of ours on that side.
Also checkpoint directories written by transformers and loaded by `load_model(path)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import LoadedModel, load_model

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Paris is the capital of",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]
NUM_NEW_TOKENS = 24


def hf_greedy(hf_model: Any, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def our_greedy(loaded: LoadedModel, prompts: list[list[int]], kv_layout: str, page_size: int,
               chunk_size: int) -> list[list[int]]:
    config = EngineConfig(loaded.config,
                          CacheConfig(page_size=page_size, num_pages=2048 // page_size,
                                      kv_layout=kv_layout),
                          SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=64))
    engine = build_engine(config, loaded.state_dict)
    requests = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS,
                                                       ignore_eos=True))
    engine.allocator.check_invariants(expect_all_free=True)
    return [r.output_token_ids for r in requests]


@pytest.fixture(scope="module")
def smollm2_prompts(hf_smollm2_tokenizer: Any) -> list[list[int]]:
    """Prompt ids from transformers' tokenizer (ours is tested equal in test_tokenizer)."""
    return [hf_smollm2_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_smollm2_outputs(hf_smollm2_model: Any, smollm2_prompts: list[list[int]]
                       ) -> list[list[int]]:
    return [hf_greedy(hf_smollm2_model, p, NUM_NEW_TOKENS) for p in smollm2_prompts]


@pytest.mark.slow
@pytest.mark.parametrize(("kv_layout", "page_size", "chunk_size"),
                         [("NHD", 16, 512), ("HND", 16, 7), ("NHD", 1, 5), ("HND", 5, 3)])
def test_smollm2_batched_greedy_matches_transformers(
        smollm2_model: LoadedModel, smollm2_prompts: list[list[int]],
        hf_smollm2_outputs: list[list[int]], kv_layout: str, page_size: int,
        chunk_size: int) -> None:
    """All prompts served concurrently decode exactly transformers' 24 greedy tokens each."""
    ours = our_greedy(smollm2_model, smollm2_prompts, kv_layout, page_size, chunk_size)
    assert ours == hf_smollm2_outputs


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tied"),
                         [(4, 4, True), (4, 2, False), (4, 1, True)],
                         ids=["mha-tied", "gqa-untied", "mqa-tied"])
def test_checkpoint_dir_through_loader_matches_transformers(
        make_hf_llama_checkpoint: Any, num_heads: int, num_kv_heads: int, tied: bool) -> None:
    """A checkpoint saved by transformers, loaded by `load_model(path)`, decodes its tokens."""
    import transformers

    path: Path = make_hf_llama_checkpoint(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                          tied=tied, initializer_range=0.2)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    prompts = [[5, 9, 13, 200, 7, 7, 1], [100, 3, 44]]
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]
    assert our_greedy(load_model(str(path)), prompts, "HND", page_size=3, chunk_size=4) == expected
