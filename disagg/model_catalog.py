"""The published shapes of the models S9's deployments serve, as engine `ModelConfig`s (S9).

DeepSeek-R1 (DeepSeek-V3's shape: MLA, 256 routed experts) and Qwen3-Coder-480B-A35B (GQA,
160 experts), each field copied from the model's `config.json` on the Hugging Face Hub, and
SmolLM2-135M, the dense Llama the demos run. Far too big to run here (except SmolLM2): they
are data. The simulator derives its presets from them (`sim/models.py`) and `disagg models`
prints what each attention costs on the wire, so both use the same numbers as the engine.
"""

from __future__ import annotations

from disagg.model_config import MLAConfig, ModelConfig, MoEConfig, RopeScaling

PUBLISHED: dict[str, ModelConfig] = {
    # deepseek-ai/DeepSeek-R1 config.json (DeepseekV3ForCausalLM).
    "deepseek-r1": ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61,
        num_heads=128, num_kv_heads=1, head_dim=576, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=163840, bos_token_id=0, eos_token_ids=(1,),
        name="deepseek-r1", architecture="deepseek_v3",
        rope_scaling=RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        moe=MoEConfig(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                      routing="sigmoid_grouped", norm_topk_prob=True, num_shared_experts=1,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5, first_dense_layers=3),
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, q_lora_rank=1536)),
    # Qwen/Qwen3-Coder-480B-A35B-Instruct config.json (Qwen3MoeForCausalLM).
    "qwen3-coder-480b": ModelConfig(
        vocab_size=151936, hidden_size=6144, intermediate_size=8192, num_layers=62,
        num_heads=96, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=10000000.0,
        max_position_embeddings=262144, eos_token_ids=(151645,), name="qwen3-coder-480b",
        architecture="qwen3_moe", qk_norm=True,
        moe=MoEConfig(num_experts=160, num_experts_per_tok=8, moe_intermediate_size=2560,
                      routing="softmax", norm_topk_prob=True)),
    # HuggingFaceTB/SmolLM2-135M config.json (LlamaForCausalLM).
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,), name="smollm2-135m"),
}


def published(name: str) -> ModelConfig:
    """A published shape by name; `KeyError` naming the choices otherwise."""
    if name not in PUBLISHED:
        raise KeyError(f"no published shape {name!r}: expected one of {sorted(PUBLISHED)}")
    return PUBLISHED[name]
