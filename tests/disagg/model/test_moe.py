"""The mixture-of-experts block equals transformers' (Qwen3-MoE, DeepSeek-V3), and its TP split.

The references are `Qwen3MoeSparseMoeBlock` and `DeepseekV3MoE` built here with random weights.
In memory they hold the experts fused (`gate_up_proj` ``[E, 2I, H]``, gate rows first, and
`down_proj` ``[E, H, I]``); their checkpoints, and our modules, name each expert apart.
"""

from __future__ import annotations

import pytest
import torch

from disagg.errors import ConfigError
from disagg.model.moe import MoE
from disagg.model.moe_routing import sigmoid_grouped_top_k
from disagg.model.sharding import Sharding
from disagg.model.tensor_parallel import Cut, TPShard, check_tp
from disagg.model.weight_shards import parameter_shapes, rank_cuts
from disagg.model_config import ModelConfig, MoEConfig

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

HIDDEN = 32
EXPERT_INNER = 16


def _qwen_moe(norm_topk_prob: bool = True) -> MoEConfig:
    return MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=EXPERT_INNER,
                     norm_topk_prob=norm_topk_prob)


def _deepseek_moe(norm_topk_prob: bool = True) -> MoEConfig:
    return MoEConfig(num_experts=16, num_experts_per_tok=3, moe_intermediate_size=EXPERT_INNER,
                     routing="sigmoid_grouped", norm_topk_prob=norm_topk_prob,
                     num_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _model_config(moe: MoEConfig, num_layers: int = 1) -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=48,
                       num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8, moe=moe)


def _hf_block(moe: MoEConfig, seed: int = 0) -> torch.nn.Module:
    """transformers' block for `moe`, every parameter (and DeepSeek's bias) random."""
    if moe.routing == "softmax":
        hf_config = transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=EXPERT_INNER, num_experts=moe.num_experts,
            num_experts_per_tok=moe.num_experts_per_tok, norm_topk_prob=moe.norm_topk_prob)
        block = Qwen3MoeSparseMoeBlock(hf_config)
    else:
        hf_config = transformers.DeepseekV3Config(
            hidden_size=HIDDEN, moe_intermediate_size=EXPERT_INNER,
            n_routed_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
            n_shared_experts=moe.num_shared_experts, n_group=moe.n_group,
            topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
            norm_topk_prob=moe.norm_topk_prob)
        block = DeepseekV3MoE(hf_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
    return block.eval()


def _our_names(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF block's weights as per-expert tensors, named as its checkpoints name them."""
    state = dict(block.state_dict())
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2, dim=0)  # [I, H] each: gate rows come first
        state |= {f"experts.{e}.gate_proj.weight": gate, f"experts.{e}.up_proj.weight": up,
                  f"experts.{e}.down_proj.weight": down[e]}
    return state


def _ours(moe: MoEConfig, state: dict[str, torch.Tensor], shard: TPShard | None = None) -> MoE:
    """Our block on rank `shard` (default: the whole thing), loaded with its slices of `state`."""
    shard = shard or TPShard.single(2)
    block = MoE(_model_config(moe), shard)
    cuts = {f"{prefix}.{name}": cut for prefix, module in block.named_modules()
            if module is not block and hasattr(module, "tp_cuts")
            for name, cut in module.tp_cuts().items()}
    block.load_state_dict({name: cuts[name].apply(t) if name in cuts else t
                           for name, t in state.items()})
    return block.eval()


def _tokens(num_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _hf_out(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x.view(1, -1, HIDDEN)).view(-1, HIDDEN)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_block_matches_hf(family: str, norm_topk_prob: bool) -> None:
    """Routing, experts and (DeepSeek) shared experts give transformers' output."""
    moe = (_qwen_moe if family == "qwen3_moe" else _deepseek_moe)(norm_topk_prob)
    hf = _hf_block(moe)
    x = _tokens(40)
    with torch.no_grad():
        ours = _ours(moe, _our_names(hf))(x)
    torch.testing.assert_close(ours, _hf_out(hf, x), atol=1e-5, rtol=1e-5)


def test_deepseek_case_needs_the_bias_and_the_groups() -> None:
    """The DeepSeek inputs above are ones where the bias and the group limit change the
    choice, so the comparison with transformers checks both."""
    moe = _deepseek_moe()
    hf = _hf_block(moe)
    logits = torch.nn.functional.linear(_tokens(40), hf.gate.weight)
    bias = hf.gate.e_score_correction_bias
    chosen = sigmoid_grouped_top_k(logits, bias, moe)[1].sort().values
    unbiased = sigmoid_grouped_top_k(logits, torch.zeros_like(bias), moe)[1].sort().values
    ungrouped = (logits.sigmoid() + bias).topk(moe.num_experts_per_tok).indices.sort().values
    assert not torch.equal(chosen, unbiased)
    assert not torch.equal(chosen, ungrouped)
    groups = chosen // (moe.num_experts // moe.n_group)  # every token within topk_group groups
    assert all(len(set(row)) <= moe.topk_group for row in groups.tolist())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_tp2_ranks_sum_to_the_whole_block(family: str) -> None:
    """Two ranks' partial outputs (identity all-reduce) add up to the TP 1 output."""
    moe = _qwen_moe() if family == "qwen3_moe" else _deepseek_moe()
    state = _our_names(_hf_block(moe))
    x = _tokens(24)
    with torch.no_grad():
        whole = _ours(moe, state)(x)
        ranks = [_ours(moe, state, TPShard(r, Sharding(2, 2))) for r in range(2)]
        parts = [rank(x) for rank in ranks]
    assert ranks[1].experts[3].up_proj.weight.shape == (EXPERT_INNER // 2, HIDDEN)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_all_reduce_runs_once_over_routed_and_shared_experts() -> None:
    """The block reduces once per forward, and what it reduces includes the shared experts."""
    moe = _deepseek_moe()
    state = _our_names(_hf_block(moe))
    reduced: list[torch.Tensor] = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        reduced.append(t.clone())
        return t * 0  # a reduction the output must come from

    block = _ours(moe, state, TPShard(0, Sharding(1, 2), all_reduce))
    x = _tokens(5)
    with torch.no_grad():
        out = block(x)
        shared = block.shared_experts(x)
        routed = block.routed_experts(x, *block.gate(x))
    assert len(reduced) == 1
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(reduced[0], routed + shared)


def test_experts_without_tokens_and_an_empty_batch() -> None:
    """One token leaves most experts idle; zero tokens give an empty output."""
    moe = _deepseek_moe()
    hf = _hf_block(moe)
    block = _ours(moe, _our_names(hf))
    x = _tokens(1)
    with torch.no_grad():
        torch.testing.assert_close(block(x), _hf_out(hf, x), atol=1e-5, rtol=1e-5)
        assert block(x[:0]).shape == (0, HIDDEN)


def test_dense_experts_equal_routed_experts() -> None:
    """The static-shape path a CUDA graph captures gives the routed path's sum."""
    moe = _qwen_moe()
    block = _ours(moe, _our_names(_hf_block(moe)))
    x = _tokens(7)
    with torch.no_grad():
        weights, experts = block.gate(x)
        torch.testing.assert_close(block.dense_experts(x, weights, experts),
                                   block.routed_experts(x, weights, experts))


def test_parameter_names_and_tp_cuts_cover_every_expert() -> None:
    """Checkpoint names per expert; the router whole; every expert weight cut at TP 2."""
    config = _model_config(_deepseek_moe(), num_layers=2)
    shapes = parameter_shapes(config)
    assert shapes["layers.1.mlp.gate.weight"] == (16, HIDDEN)
    assert shapes["layers.1.mlp.gate.e_score_correction_bias"] == (16,)
    assert shapes["layers.0.mlp.shared_experts.up_proj.weight"] == (2 * EXPERT_INNER, HIDDEN)
    cuts = rank_cuts(config, TPShard(1, Sharding(2, 2)))
    assert cuts["layers.0.mlp.experts.3.up_proj.weight"] == Cut(0, 8, 16)
    assert cuts["layers.1.mlp.experts.15.down_proj.weight"] == Cut(1, 8, 16)
    assert cuts["layers.0.mlp.shared_experts.down_proj.weight"] == Cut(1, 16, 32)
    split = {name for name in shapes if "experts" in name}
    assert {name for name in cuts if ".mlp." in name} == split


def test_check_tp_refuses_an_expert_size_it_cannot_split() -> None:
    """TP must divide moe_intermediate_size, and the error names it."""
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
    with pytest.raises(ConfigError, match="moe_intermediate_size 6"):
        check_tp(_model_config(moe), Sharding(4, 2))


def test_groups_of_one_expert_are_refused() -> None:
    """A group scores its best two experts, so a group of one is a config error."""
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    routing="sigmoid_grouped", n_group=4, topk_group=2)
    with pytest.raises(ConfigError, match="n_group=4"):
        MoE(_model_config(moe), TPShard.single(2))
