"""RoPE and its scalings (`disagg.model.rope`) against transformers' own rotary embedding.

The reference is `LlamaRotaryEmbedding` built from a `LlamaConfig` with the same
`rope_parameters`: cos and sin agree within 1e-6 below and above the original length, for each
rope_type, and dynamic NTK follows each request's own length.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.rope import RotaryEmbedding
from disagg.model_config import RopeScaling

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

HEAD_DIM, THETA, MAX_POSITIONS, ORIGINAL = 32, 10000.0, 256, 64

CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": ORIGINAL},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3,
                              "truncate": False, "original_max_position_embeddings": ORIGINAL},
}


def hf_rotary(params: dict[str, Any], max_positions: int = MAX_POSITIONS) -> Any:  # noqa: ANN401
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=max_positions, rope_parameters={"rope_theta": THETA, **params})
    return LlamaRotaryEmbedding(config)


def ours(params: dict[str, Any], max_positions: int = MAX_POSITIONS) -> RotaryEmbedding:
    scaling = RopeScaling(**params)
    if scaling.rope_type == "dynamic":  # grows from the model's own length (hf_config.py)
        scaling = RopeScaling(**params, original_max_position_embeddings=max_positions)
    return RotaryEmbedding(HEAD_DIM, max_positions, THETA, scaling)


def hf_cos_sin(rotary: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN401
    x = torch.zeros(1, len(positions), HEAD_DIM)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("case", list(CASES))
def test_cos_sin_equal_transformers(case: str) -> None:
    """Every position of the table (the original length is 64 of 256) agrees within 1e-6."""
    positions = torch.arange(MAX_POSITIONS)
    if case == "dynamic":  # static below the model's length; past it see the next tests
        positions = torch.arange(MAX_POSITIONS - 5)
    cos, sin = ours(CASES[case]).cos_sin(positions)
    ref_cos, ref_sin = hf_cos_sin(hf_rotary(CASES[case]), positions)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)


def test_scalings_change_the_rotation() -> None:
    """Each scaling differs from plain RoPE somewhere (so the comparisons above can fail)."""
    plain, _ = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, THETA).cos_sin(torch.arange(200))
    for case in CASES:
        if case != "dynamic":
            scaled, _ = ours(CASES[case]).cos_sin(torch.arange(200))
            assert (scaled - plain).abs().max() > 1e-2, case


def test_dynamic_past_the_length_follows_transformers_prefill_then_decode() -> None:
    """A 300-token prompt (the model's length is 256) in one forward, then two decodes: each
    forward's cos/sin equal those of transformers' stateful embedding fed the same calls."""
    params = CASES["dynamic"]
    rope, reference = ours(params), hf_rotary(params)
    plain, _ = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, THETA).cos_sin(torch.arange(10))
    for positions in (torch.arange(300), torch.tensor([300]), torch.tensor([301])):
        cos, sin = rope.cos_sin(positions)
        ref_cos, ref_sin = hf_cos_sin(reference, positions)
        torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)
    assert (rope.cos_sin(torch.arange(300))[0][:10] - plain).abs().max() > 1e-3  # it scaled


def test_dynamic_uses_each_requests_own_length() -> None:
    """One batch of a short and a long request: each gets the rotation it would alone."""
    params = CASES["dynamic"]
    rope = ours(params)
    short, long = torch.arange(40), torch.arange(290)
    meta = AttentionMetadata(
        torch.zeros(330, dtype=torch.int64), torch.zeros(330, dtype=torch.int64),
        [SequenceSlice(0, 40, 0, torch.zeros(1, dtype=torch.int64)),
         SequenceSlice(40, 290, 0, torch.zeros(1, dtype=torch.int64))])
    cos, _ = rope.cos_sin(torch.cat((short, long)), meta)
    torch.testing.assert_close(cos[:40], hf_cos_sin(hf_rotary(params), short)[0],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(cos[40:], hf_cos_sin(hf_rotary(params), long)[0],
                               atol=1e-6, rtol=0)


def test_rotate_matches_transformers_apply() -> None:
    """The rotation itself: rotate-half, as `apply_rotary_pos_emb` does it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    rope = ours(CASES["yarn-mscale"])
    x = torch.randn(7, 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 255])
    cos, sin = rope.cos_sin(positions)
    reference, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None],
                                        cos[None], sin[None])
    torch.testing.assert_close(rope(x, positions), reference[0].transpose(0, 1),
                               atol=1e-6, rtol=0)


def test_a_position_past_the_table_is_an_error() -> None:
    """Static scalings hold max_positions rows; a position past them fails (no host-side
    check: that would read the positions every layer of every step)."""
    with pytest.raises(IndexError):
        ours(CASES["yarn"]).cos_sin(torch.tensor([3, 256]))
