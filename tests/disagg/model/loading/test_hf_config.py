"""Reading config.json (`disagg.model.loading.hf_config`) for every architecture we run.

Each config.json is written by transformers' own config class (`save_pretrained`), as a
checkpoint of that architecture carries it; it must parse to the expected `ModelConfig`
fields, and what the model cannot run exactly is refused with a message naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagg.errors import ModelLoadError
from disagg.model.loading.hf_config import config_from_hf
from disagg.model_config import MLAConfig, ModelConfig, MoEConfig, RopeScaling

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512}


def written(tmp_path: Path, family: str, **fields: Any) -> dict[str, Any]:  # noqa: ANN401
    """config.json as transformers writes it for `{family}ForCausalLM`, read back."""
    config = getattr(transformers, f"{family}Config")(**(SMALL | fields))
    config.architectures = [f"{family}ForCausalLM"]
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def parse(raw: dict[str, Any]) -> ModelConfig:
    return config_from_hf(raw, None, source="config.json")


def test_llama(tmp_path: Path) -> None:
    """Shapes, tying, eps, token ids, and attention_bias biasing every projection."""
    config = parse(written(tmp_path, "Llama", rms_norm_eps=1e-5, tie_word_embeddings=True,
                           attention_bias=True, bos_token_id=1, eos_token_id=2))
    assert (config.architecture, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "llama", 8, 2, 8)
    assert (config.num_layers, config.vocab_size, config.max_position_embeddings) == (4, 256, 512)
    assert (config.tie_word_embeddings, config.rms_norm_eps) == (True, 1e-5)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert (config.attention_bias, config.o_proj_bias, config.qk_norm) == (True, True, False)
    assert (config.rope_scaling, config.moe, config.mla) == (None, None, None)


def test_mistral_without_window(tmp_path: Path) -> None:
    """Mistral with no sliding window (or one as long as the context) is full attention; its
    modelling file has no biases whatever attention_bias says."""
    for window in (None, 512):
        config = parse(written(tmp_path, "Mistral", sliding_window=window, head_dim=16))
        assert (config.architecture, config.head_dim, config.attention_bias) == (
            "mistral", 16, False)


def test_qwen2_biases_qkv_not_o(tmp_path: Path) -> None:
    config = parse(written(tmp_path, "Qwen2", tie_word_embeddings=True))
    assert (config.architecture, config.attention_bias, config.o_proj_bias) == (
        "qwen2", True, False)
    assert (config.qk_norm, config.head_dim, config.tie_word_embeddings) == (False, 8, True)


def test_qwen3_norms_and_head_dim(tmp_path: Path) -> None:
    """q/k norms always; an explicit head_dim wins, and without one the class default 128."""
    config = parse(written(tmp_path, "Qwen3", head_dim=32))
    assert (config.architecture, config.qk_norm, config.head_dim) == ("qwen3", True, 32)
    assert (config.attention_bias, config.o_proj_bias) == (False, False)
    raw = written(tmp_path, "Qwen3", attention_bias=True)
    del raw["head_dim"]
    config = parse(raw)
    assert (config.head_dim, config.attention_bias, config.o_proj_bias) == (128, True, True)


def test_qwen3_moe(tmp_path: Path) -> None:
    """The experts' fields; transformers writes num_local_experts, the Hub's files num_experts."""
    raw = written(tmp_path, "Qwen3Moe", num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
                  mlp_only_layers=[1])
    expected = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         routing="softmax", norm_topk_prob=True, decoder_sparse_step=2,
                         mlp_only_layers=(1,))
    config = parse(raw)
    assert (config.architecture, config.qk_norm, config.moe) == ("qwen3_moe", True, expected)
    raw["num_experts"] = raw.pop("num_local_experts")
    assert parse(raw).moe == expected


def test_deepseek_v3(tmp_path: Path) -> None:
    """Grouped sigmoid routing, MLA's dimensions, one latent cache head, DeepSeek's yarn."""
    rope = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
    raw = written(tmp_path, "DeepseekV3", n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.5,
                  n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32,
                  q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  rope_scaling=rope)
    raw |= {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    config = parse(raw)
    assert config.moe == MoEConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        routing="sigmoid_grouped", norm_topk_prob=True, num_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_dense_layers=1)
    assert config.mla == MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                   v_head_dim=16, q_lora_rank=None, rope_interleave=True)
    assert (config.num_kv_heads, config.head_dim, config.rope_dim) == (1, 40, 8)
    assert config.rope_scaling == RopeScaling(
        "yarn", factor=40.0, original_max_position_embeddings=64, mscale=1.0,
        mscale_all_dim=1.0)


ROPES = {
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64)),
    "linear": ({"rope_type": "linear", "factor": 2.0}, RopeScaling("linear", factor=2.0)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
              "attention_factor": 1.2, "truncate": False},
             RopeScaling("yarn", factor=4.0, original_max_position_embeddings=128,
                         attention_factor=1.2, truncate=False)),
    # Dynamic NTK grows from the model's own length, and the context served is factor x it.
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0},
                RopeScaling("dynamic", factor=2.0, original_max_position_embeddings=512)),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_scaling_in_both_formats(tmp_path: Path, kind: str) -> None:
    """`rope_parameters` (transformers 5) and top-level rope_theta + `rope_scaling` agree."""
    params, expected = ROPES[kind]
    new = written(tmp_path, "Llama", rope_parameters={"rope_theta": 5e5, **params})
    old = dict(new)
    old["rope_theta"] = old.pop("rope_parameters")["rope_theta"]
    old["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in params.items()}
    for raw in (new, old):
        config = parse(raw)
        assert (config.rope_theta, config.rope_scaling) == (5e5, expected)
        assert config.max_position_embeddings == (1024 if kind == "dynamic" else 512)


def test_yarn_factor_and_original_length_defaults(tmp_path: Path) -> None:
    """No factor: max_position_embeddings / original; a top-level original length wins."""
    raw = written(tmp_path, "Llama", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 128})
    raw["rope_parameters"]["factor"] = None
    assert parse(raw).rope_scaling == RopeScaling("yarn", 4.0, 128)
    raw["original_max_position_embeddings"] = 256
    assert parse(raw).rope_scaling == RopeScaling("yarn", 2.0, 256)


def _set(**changes: Any):  # noqa: ANN202
    return lambda raw: raw.update(changes)


REFUSED: dict[str, tuple[str, Any, str]] = {
    "other-architecture": ("Llama", _set(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
                           "supported architectures: LlamaForCausalLM, MistralForCausalLM, "
                           "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
                           "DeepseekV3ForCausalLM"),
    "type-mismatch": ("Llama", _set(model_type="qwen2"), "model_type='qwen2'"),
    "mistral-window": ("Mistral", _set(sliding_window=128), "sliding_window=128"),
    "qwen2-window": ("Qwen2", _set(use_sliding_window=True), "use_sliding_window=true"),
    "qwen3-layer-types": ("Qwen3", _set(layer_types=["full_attention", "sliding_attention"] * 2),
                          "layer_types ['sliding_attention']"),
    "hidden-act": ("Qwen2", _set(hidden_act="gelu"), "hidden_act='gelu'"),
    "mlp-bias": ("Llama", _set(mlp_bias=True), "mlp_bias=true"),
    "longrope": ("Llama", _set(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
                 "rope_type='longrope'"),
    "partial-rotary": ("Llama", _set(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    "llama3-field": ("Llama", _set(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                    "high_freq_factor": 4.0}),
                     "low_freq_factor is required"),
    "topk-method": ("DeepseekV3", _set(topk_method="greedy"), "topk_method='greedy'"),
    "scoring-func": ("DeepseekV3", _set(scoring_func="softmax"), "scoring_func='softmax'"),
    "moe-layer-freq": ("DeepseekV3", _set(moe_layer_freq=2), "moe_layer_freq=2"),
    "no-experts": ("Qwen3Moe", lambda raw: raw.pop("num_local_experts"), "'num_experts'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_name_the_field(tmp_path: Path, case: str) -> None:
    """One `ModelLoadError` naming the file and the field it cannot run."""
    family, edit, message = REFUSED[case]
    raw = written(tmp_path, family, **({"n_group": 1, "topk_group": 1, "n_routed_experts": 4,
                                        "num_experts_per_tok": 2}
                                       if family == "DeepseekV3" else {}))
    edit(raw)
    with pytest.raises(ModelLoadError) as info:
        parse(raw)
    assert message in str(info.value)
    assert str(info.value).startswith("config.json: ")
