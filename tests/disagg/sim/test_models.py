"""Model presets: parameter and KV-cache counts against the published figures (S9a, S9b)."""

from __future__ import annotations

import pytest

from disagg.config import ModelConfig
from disagg.errors import ConfigError
from disagg.sim.models import PRESETS, SimModel, from_model_config, model_from_name


@pytest.mark.parametrize(("name", "total", "active"), [
    ("deepseek-r1", 671e9, 37e9),  # DeepSeek-V3 report: 671B total, 37B activated
    ("qwen3-coder-480b", 480e9, 35e9),  # model card: 480B total, 35B activated
    ("smollm2-135m", 135e6, 135e6),
])
def test_parameter_counts_match_model_cards(name: str, total: float, active: float) -> None:
    """Counting weights from the config lands within 2% of the published totals."""
    model = PRESETS[name]
    assert model.total_params == pytest.approx(total, rel=0.02)
    assert model.active_params == pytest.approx(active, rel=0.02)


def test_mla_ships_a_latent_gqa_ships_heads() -> None:
    """R1: 61 layers x (512 + 64) x 2 bytes; Qwen3-Coder: 62 layers x 2 x 8 x 128 x 2 bytes."""
    assert PRESETS["deepseek-r1"].kv_bytes_per_token == 61 * 576 * 2
    assert PRESETS["qwen3-coder-480b"].kv_bytes_per_token == 62 * 2 * 8 * 128 * 2


def test_one_token_touches_exactly_k_experts() -> None:
    """The expected distinct experts are k for one token and approach E for many."""
    r1 = PRESETS["deepseek-r1"]
    assert r1.expected_active_experts(1) == pytest.approx(8)
    assert r1.expected_active_experts(10_000) == pytest.approx(256)
    assert r1.expected_active_experts(0) == 0


def test_mla_attention_dims_differ_between_prefill_and_decode() -> None:
    """Decode attends in the absorbed latent space, prefill in per-head dims."""
    r1 = PRESETS["deepseek-r1"]
    assert r1.attention_dims(decode=True) == (128, 576, 512)
    assert r1.attention_dims(decode=False) == (128, 192, 128)


def test_from_model_config_keeps_the_engine_shape() -> None:
    """The `tiny` engine preset becomes a dense fp32 GQA model with the same dims."""
    model = from_model_config(ModelConfig.from_name("tiny"))
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 4, 8)
    assert model.num_moe_layers == 0
    assert model.weight_bytes == 4


def test_unknown_model_names_the_choices() -> None:
    """A typo raises ConfigError listing the presets."""
    with pytest.raises(ConfigError, match="deepseek-r1"):
        model_from_name("deepseek-r2")


def test_gqa_needs_heads() -> None:
    """A GQA model without KV heads is refused at construction."""
    with pytest.raises(ConfigError, match="num_kv_heads"):
        SimModel(name="bad", num_layers=1, hidden_size=8, vocab_size=8, num_heads=2)
