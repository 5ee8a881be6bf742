"""Loading Hugging Face Llama checkpoint directories (`disagg.model.loading.hf`).

The reference is transformers itself: checkpoints are written by `LlamaForCausalLM` in the
test, then our state dict must equal the model's, tensor for tensor. Malformed checkpoints
must be refused with a `ModelLoadError` that names the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.config import ModelConfig
from disagg.errors import ModelLoadError
from disagg.model.loading.hf import load_hf_checkpoint
from disagg.model.loading.tokenizer import Tokenizer
from disagg.model.weight_shards import parameter_shapes

SHAPES = [(4, 4, False), (4, 4, True), (4, 2, False), (4, 2, True), (4, 1, False), (4, 1, True)]
SHAPE_IDS = ["mha-untied", "mha-tied", "gqa-untied", "gqa-tied", "mqa-untied", "mqa-tied"]


def _hf_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(directory)
    return {name.removeprefix("model."): tensor for name, tensor in model.state_dict().items()}


def _edit_config(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _to_old_rope_format(raw: dict[str, Any]) -> None:
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tied"), SHAPES, ids=SHAPE_IDS)
def test_state_dict_equals_transformers(make_hf_llama_checkpoint: Callable[..., Path],
                                        num_heads: int, num_kv_heads: int, tied: bool) -> None:
    """Every tensor equals transformers' own load of the checkpoint (lm_head only if untied)."""
    directory = make_hf_llama_checkpoint(num_heads, num_kv_heads, tied)
    config, state_dict, tokenizer = load_hf_checkpoint(directory)
    reference = _hf_state_dict(directory)
    if tied:
        assert torch.equal(reference.pop("lm_head.weight"), state_dict["embed_tokens.weight"])
    assert state_dict.keys() == reference.keys()
    for name, tensor in reference.items():
        assert state_dict[name].dtype == torch.float32
        assert torch.equal(state_dict[name], tensor), name
    assert tokenizer is None


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "tied"), SHAPES, ids=SHAPE_IDS)
def test_config_fields(make_hf_llama_checkpoint: Callable[..., Path], num_heads: int,
                       num_kv_heads: int, tied: bool) -> None:
    """Head counts, head_dim, tying, rope theta, eps and token ids come from config.json."""
    config, _, _ = load_hf_checkpoint(make_hf_llama_checkpoint(num_heads, num_kv_heads, tied))
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        num_heads, num_kv_heads, 64 // num_heads)
    assert config.tie_word_embeddings is tied
    assert (config.rope_theta, config.rms_norm_eps) == (500000.0, 1e-5)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert (config.vocab_size, config.num_layers, config.max_position_embeddings) == (256, 2, 512)


def test_old_and_new_rope_formats_agree(make_hf_llama_checkpoint: Callable[..., Path]) -> None:
    """Top-level `rope_theta` (older transformers) and `rope_parameters` give the same config."""
    new_dir = make_hf_llama_checkpoint()
    old_dir = make_hf_llama_checkpoint()
    _edit_config(old_dir, _to_old_rope_format)
    assert "rope_parameters" in json.loads((new_dir / "config.json").read_text())
    new_config, _, _ = load_hf_checkpoint(new_dir)
    old_config, _, _ = load_hf_checkpoint(old_dir)
    assert replace(old_config, name=new_config.name) == new_config
    assert old_config.rope_theta == 500000.0


def test_explicit_head_dim_is_used(make_hf_llama_checkpoint: Callable[..., Path]) -> None:
    """An explicit head_dim that is not hidden_size // num_heads wins."""
    config, state_dict, _ = load_hf_checkpoint(make_hf_llama_checkpoint(head_dim=32))
    assert config.head_dim == 32
    assert state_dict["layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)


def test_eos_list_from_generation_config(make_hf_llama_checkpoint: Callable[..., Path]) -> None:
    """generation_config.json's eos_token_id (a list here) overrides config.json's."""
    directory = make_hf_llama_checkpoint()
    path = directory / "generation_config.json"
    generation = json.loads(path.read_text())
    generation["eos_token_id"] = [2, 7]
    path.write_text(json.dumps(generation))
    config, _, _ = load_hf_checkpoint(directory)
    assert config.eos_token_ids == (2, 7)


def test_sharded_checkpoint(make_hf_llama_checkpoint: Callable[..., Path]) -> None:
    """A `model.safetensors.index.json` with several shards loads the same tensors."""
    directory = make_hf_llama_checkpoint(max_shard_size="40KB")
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    _, state_dict, _ = load_hf_checkpoint(directory)
    reference = _hf_state_dict(directory)
    assert all(torch.equal(state_dict[name], tensor) for name, tensor in reference.items())


def test_bf16_weights_become_fp32(make_hf_llama_checkpoint: Callable[..., Path]) -> None:
    """Half-precision checkpoints are converted to fp32 exactly."""
    directory = make_hf_llama_checkpoint()
    weights = load_file(directory / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              directory / "model.safetensors")
    _, state_dict, _ = load_hf_checkpoint(directory)
    name = "layers.1.mlp.up_proj.weight"
    assert state_dict[name].dtype == torch.float32
    assert torch.equal(state_dict[name], weights[f"model.{name}"].to(torch.bfloat16).float())


def test_tokenizer_json_is_loaded(make_hf_llama_checkpoint: Callable[..., Path],
                                  tiny_tokenizer: Tokenizer) -> None:
    """A checkpoint with tokenizer.json gets a tokenizer carrying the config's token ids."""
    directory = make_hf_llama_checkpoint()
    tiny_tokenizer.save(directory / "tokenizer.json")
    _, _, tokenizer = load_hf_checkpoint(directory)
    assert tokenizer is not None
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, (2,))
    assert tokenizer.encode("the cat") == tiny_tokenizer.encode("the cat")


def test_parameter_shapes_counts_tied_and_untied() -> None:
    """A tied model has no lm_head entry; an untied one has it with the embedding's shape."""
    config = ModelConfig.from_name("tiny")
    tied = parameter_shapes(replace(config, tie_word_embeddings=True))
    untied = parameter_shapes(replace(config, tie_word_embeddings=False))
    assert "lm_head.weight" not in tied
    assert untied["lm_head.weight"] == (config.vocab_size, config.hidden_size)
    assert len(untied) == len(tied) + 1 == 2 + 9 * config.num_layers + 1


def _remove(name: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).unlink()


def _drop_tensor(directory: Path) -> None:
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, directory / "model.safetensors")


def _shrink_tensor(directory: Path) -> None:
    weights = load_file(directory / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, directory / "model.safetensors")


def _config_edit(**changes: Any) -> Callable[[Path], None]:
    return lambda directory: _edit_config(directory, lambda raw: raw.update(changes))


def _old_format_scaling(directory: Path) -> None:
    def edit(raw: dict[str, Any]) -> None:
        _to_old_rope_format(raw)
        raw["rope_scaling"] = {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}

    _edit_config(directory, edit)


MALFORMED: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing-config": (_remove("config.json"), "config.json is missing"),
    "missing-weights": (_remove("model.safetensors"), "no weights found"),
    "missing-tensor": (_drop_tensor, "missing tensor(s) layers.1.self_attn.v_proj.weight"),
    "misshaped-tensor": (_shrink_tensor, "norm.weight has shape (63,), expected (64,)"),
    "other-architecture": (_config_edit(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
                           "supported architectures: LlamaForCausalLM, MistralForCausalLM"),
    "bias-without-tensors": (_config_edit(attention_bias=True),
                             "missing tensor(s) layers.0.self_attn.q_proj.bias"),
    "mlp-bias": (_config_edit(mlp_bias=True), "mlp_bias=true is unsupported"),
    "rope-llama3-no-factor": (
        _config_edit(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}),
        "factor is required for rope_type 'llama3'"),
    "rope-scaling-old": (_old_format_scaling, "rope_type='longrope' is unsupported"),
    "no-heads": (_config_edit(num_attention_heads=None), "'num_attention_heads' is missing"),
    "bad-json": (lambda d: (d / "config.json").write_text("{"), "cannot parse JSON"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_refused(make_hf_llama_checkpoint: Callable[..., Path],
                                         case: str) -> None:
    """Each broken checkpoint raises ModelLoadError with a message naming the problem."""
    directory = make_hf_llama_checkpoint()
    corrupt, message = MALFORMED[case]
    corrupt(directory)
    with pytest.raises(ModelLoadError) as info:
        load_hf_checkpoint(directory)
    assert message in str(info.value)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    """A path that does not exist is named in the error."""
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
