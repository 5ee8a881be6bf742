"""The models `benchmarks/engine.py` races, each written once as a Hugging Face checkpoint.

Both sides read the same directory: our engine through `load_model(path)` (S1, S9b), and
transformers through `from_pretrained(path, dtype=...)`, which is how transformers serves a
model in half precision (not `model.to(dtype)`). A Llama-family spec such as `smollm2-135m` or
the `tiny` preset is loaded by us first and saved as a `LlamaForCausalLM`; a Qwen3-MoE model is
a random `Qwen3MoeForCausalLM` that transformers builds and saves itself. `our_engine` is how
both engine benchmarks (`engine.py`, `profile_engine.py`) build ours. Nothing here times.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig, default_of
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.model.loading.registry import LoadedModel, load_model

# Random Qwen3-MoE models by name: all layers sparse, softmax routing over normalised top-k
# (Qwen3-30B-A3B's choices). "small" is sized to be measurable on two cores: 74M parameters,
# of which a token meets 13M in the layers (2 of 16 experts) and the 8M of the head; "tiny" is
# for tests.
QWEN3_MOE_SIZES: dict[str, dict[str, int]] = {
    "qwen3-moe-small": {"vocab_size": 16384, "hidden_size": 512, "num_hidden_layers": 8,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                        "num_experts": 16, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 256},
    "qwen3-moe-tiny": {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}
# transformers' own kernels for the reference: PyTorch's fused attention (ours uses it too)
# and its eager loop over the experts (not the grouped matmul).
ATTENTION_IMPLEMENTATION = "sdpa"
EXPERTS_IMPLEMENTATION = "eager"


def write_checkpoint(spec: str, directory: Path) -> Path:
    """Save model `spec` (a Qwen3-MoE size above, or a Llama-family spec `load_model` takes)
    in float32 as a Hugging Face checkpoint in `directory`; returns `directory`."""
    import transformers

    torch.manual_seed(0)
    if spec in QWEN3_MOE_SIZES:
        config = transformers.Qwen3MoeConfig(
            **QWEN3_MOE_SIZES[spec], intermediate_size=4 * QWEN3_MOE_SIZES[spec]["hidden_size"],
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = _llama_from(spec)
    model.save_pretrained(directory)
    return directory


def _llama_from(spec: str) -> Any:  # noqa: ANN401 - a transformers LlamaForCausalLM
    """A transformers LlamaForCausalLM holding the weights `load_model(spec)` gives us."""
    import transformers

    loaded = load_model(spec)
    c = loaded.config
    plain = (c.architecture == "llama" and c.rope_scaling is None and not c.attention_bias
             and not c.qk_norm and c.moe is None and c.mla is None)
    if not plain:
        raise ValueError(f"model {spec!r} is not a plain Llama: give a Qwen3-MoE size "
                         f"({', '.join(QWEN3_MOE_SIZES)}) or a Llama-family spec")
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(hf_config)
    state = {("" if name == "lm_head.weight" else "model.") + name: tensor
             for name, tensor in loaded.state_dict.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    tied = {"lm_head.weight"} if c.tie_word_embeddings else set()
    assert set(missing) <= tied, missing  # a tied head is the embedding (below)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


def load_reference(directory: Path, dtype: torch.dtype) -> Any:  # noqa: ANN401
    """transformers' model of the checkpoint in `directory`, loaded in `dtype`."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=ATTENTION_IMPLEMENTATION,
        experts_implementation=EXPERTS_IMPLEMENTATION).eval()


def our_engine(loaded: LoadedModel, kv_layout: str, dtype: torch.dtype, prompt_len: int,
               batch: int, steps: int,
               prefix_caching: bool = default_of(CacheConfig, "prefix_caching")) -> LLMEngine:
    """Our paged engine in `dtype` (weights, activations and KV), sized for `batch` prompts of
    `prompt_len` tokens and `steps` decodes each, a prompt prefilled in one chunk."""
    num_pages = (prompt_len + steps + 32) // 16 * batch + 64
    # A step's budget holds a whole prompt beside the batch's other decodes: a batch filled one
    # prompt a step prefills each in one chunk, and all `batch` decode in every step.
    scheduler = SchedulerConfig(chunk_size=prompt_len, max_num_batched_tokens=prompt_len + batch,
                                max_num_seqs=batch)
    config = EngineConfig(loaded.config,
                          CacheConfig(page_size=16, num_pages=num_pages, kv_layout=kv_layout,
                                      dtype=dtype, prefix_caching=prefix_caching),
                          scheduler, dtype=dtype)
    return build_engine(config, loaded.state_dict)
