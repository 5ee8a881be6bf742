"""What real Hugging Face checkpoints carry beside the model transformers builds
(`disagg.model.loading.hf`, `hf_config`): DeepSeek-V3's multi-token-prediction layers are
passed over with one info line; fp8 weights (a `quantization_config`) are refused in one line.

The checkpoints are small fakes laid out as DeepSeek-V3's are: its config.json's fields, our
random weights under Hugging Face's names, plus the extras (`model.layers.{num_hidden_layers}.*`,
`weight_scale_inv` block scales).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.errors import ModelLoadError
from disagg.model.loading.hf import read_hf_config
from disagg.model.loading.registry import init_random_weights, load_model, load_tokenizer

NUM_LAYERS = 2
# DeepSeek-V3's config.json, its fields as the release writes them, at a tiny size: a dense
# layer, then a sparse one.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
    "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 8, "max_position_embeddings": 128, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}
# Besides a whole decoder layer, an MTP layer has its own norms, projection and output head.
_MTP_OWN = {"enorm.weight": (32,), "hnorm.weight": (32,), "eh_proj.weight": (32, 64),
            "embed_tokens.weight": (128, 32), "shared_head.norm.weight": (32,),
            "shared_head.head.weight": (128, 32)}


def hf_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name if name == "lm_head.weight" else f"model.{name}": tensor
            for name, tensor in weights.items()}


def deepseek_checkpoint(directory: Path, mtp_layers: int = 1) -> Path:
    """A 2-layer DeepSeek-V3 with `mtp_layers` MTP layers after them, each a copy of layer 1
    plus its own tensors."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(DEEPSEEK_V3 | {
        "num_nextn_predict_layers": mtp_layers}))
    weights = hf_names(init_random_weights(read_hf_config(directory)))
    for index in range(NUM_LAYERS, NUM_LAYERS + mtp_layers):
        weights |= {name.replace("layers.1.", f"layers.{index}."): tensor.clone()
                    for name, tensor in weights.items() if name.startswith("model.layers.1.")}
        weights |= {f"model.layers.{index}.{name}": torch.ones(shape)
                    for name, shape in _MTP_OWN.items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def fp8_checkpoint(directory: Path) -> Path:
    """`deepseek_checkpoint` as DeepSeek's FP8 release stores it: a quantization_config, and a
    `weight_scale_inv` per 128x128 block of each linear weight."""
    deepseek_checkpoint(directory)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(raw | {"quantization_config": FP8}))
    weights = load_file(directory / "model.safetensors")
    weights |= {name.replace(".weight", ".weight_scale_inv"): torch.ones(1, 1)
                for name, tensor in weights.items() if tensor.dim() == 2 and "proj" in name}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_deepseek_mtp_layers_are_skipped(tmp_path: Path) -> None:
    """DeepSeek-V3 with one MTP layer (`model.layers.2.*`): the model loads exactly the two
    decoder layers' weights, as written."""
    directory = deepseek_checkpoint(tmp_path / "ds")
    loaded = load_model(str(directory))
    written = {name.removeprefix("model."): tensor
               for name, tensor in load_file(directory / "model.safetensors").items()}
    assert not any(name.startswith("layers.2.") for name in loaded.state_dict)
    assert loaded.state_dict.keys() == init_random_weights(loaded.config).keys()
    assert all(torch.equal(tensor, written[name]) for name, tensor in loaded.state_dict.items())


def test_skipping_mtp_layers_says_so_once(tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Two MTP layers skipped: one info line, naming how many tensors and layers."""
    directory = deepseek_checkpoint(tmp_path / "ds", mtp_layers=2)
    with caplog.at_level(logging.INFO, logger="disagg.model.loading.hf"):
        load_model(str(directory))
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1
    assert "2 multi-token-prediction layer(s)" in lines[0]


def test_layers_past_the_last_are_refused_without_mtp(
        make_hf_llama_checkpoint: Callable[..., Path]) -> None:
    """A Llama checkpoint has no MTP layers: a stray `model.layers.2.*` is still refused."""
    directory = make_hf_llama_checkpoint()
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.2.input_layernorm.weight"] = torch.ones(64)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        load_model(str(directory))


def test_fp8_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    """DeepSeek-V3/R1's FP8 release (a quantization_config, `weight_scale_inv` scales): one
    line naming quantization_config, its method and what is supported."""
    directory = fp8_checkpoint(tmp_path / "ds")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(directory))
    message = str(info.value)
    assert "\n" not in message
    assert "quantization_config (quant_method='fp8')" in message
    assert "bfloat16" in message


def test_the_front_door_refuses_fp8_too(tmp_path: Path) -> None:
    """`load_tokenizer` (the front door's load) gives the same refusal, before any node."""
    directory = fp8_checkpoint(tmp_path / "ds")
    with pytest.raises(ModelLoadError, match="quantization_config"):
        load_tokenizer(str(directory))
