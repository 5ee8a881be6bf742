"""`load_model` dispatch, deterministic random init, and what the front door loads (only the
tokenizer, `load_tokenizer`) (`disagg.model.loading.registry`)."""

from __future__ import annotations

import json
import queue
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from disagg.config import ModelConfig
from disagg.errors import ModelLoadError
from disagg.model.loading.hf_config import ARCHITECTURES
from disagg.model.loading.registry import (
    LoadedModel,
    init_random_weights,
    load_model,
    load_tokenizer,
    model_config,
    model_names,
)
from disagg.model.loading.tokenizer import Tokenizer
from disagg.model.weight_shards import parameter_shapes


def test_preset_loads_random_weights_without_tokenizer() -> None:
    """A preset name gives its config, every parameter in fp32, and no tokenizer."""
    loaded = load_model("tiny")
    assert loaded.config == ModelConfig.from_name("tiny")
    assert loaded.tokenizer is None
    shapes = parameter_shapes(loaded.config)
    assert {k: tuple(v.shape) for k, v in loaded.state_dict.items()} == shapes
    assert all(v.dtype == torch.float32 for v in loaded.state_dict.values())


def test_random_init_is_deterministic_per_seed() -> None:
    """Same seed: identical tensors; another seed: different matrices."""
    config = ModelConfig.from_name("tiny")
    first, again = init_random_weights(config), init_random_weights(config)
    other = init_random_weights(config, seed=1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["layers.0.mlp.up_proj.weight"],
                           other["layers.0.mlp.up_proj.weight"])


def test_random_init_values() -> None:
    """Norm weights are ones; matrices are small zero-mean normals (std 0.02)."""
    weights = init_random_weights(ModelConfig.from_name("tiny"))
    assert torch.equal(weights["norm.weight"], torch.ones(64))
    assert torch.equal(weights["layers.1.post_attention_layernorm.weight"], torch.ones(64))
    embed = weights["embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.001
    assert abs(embed.mean().item()) < 0.001


def test_checkpoint_directory_spec(make_hf_llama_checkpoint: Callable[..., Path]) -> None:
    """A directory path is loaded as a Hugging Face checkpoint named after the folder."""
    directory = make_hf_llama_checkpoint(4, 1, True)
    loaded = load_model(str(directory))
    assert isinstance(loaded, LoadedModel)
    assert (loaded.config.num_kv_heads, loaded.config.name) == (1, directory.name)
    assert "lm_head.weight" not in loaded.state_dict


def test_unknown_name_lists_valid_names() -> None:
    """An unknown spec is named in the error together with every valid name."""
    with pytest.raises(ModelLoadError) as info:
        load_model("llama-9000")
    message = str(info.value)
    assert "'llama-9000'" in message
    assert all(name in message for name in ["smollm2-135m", "tiny", "small"])
    assert model_names()[0] == "smollm2-135m"


def test_missing_path_is_unknown_model(tmp_path: Path) -> None:
    """A path that does not exist is refused, naming it."""
    with pytest.raises(ModelLoadError, match="no-such-dir"):
        load_model(str(tmp_path / "no-such-dir"))


def test_file_path_is_refused(tmp_path: Path) -> None:
    """A path to a file (not a checkpoint directory) is refused."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(str(tmp_path / "model.safetensors"))


@pytest.mark.slow
def test_smollm2_spec(smollm2_model: LoadedModel) -> None:
    """`smollm2-135m` loads the GGUF: 30 layers, 9 query / 3 KV heads, tied, a tokenizer."""
    config = smollm2_model.config
    assert (config.name, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "smollm2-135m", 30, 9, 3)
    assert config.tie_word_embeddings
    assert smollm2_model.tokenizer is not None
    assert smollm2_model.state_dict.keys() == parameter_shapes(config).keys()


def test_load_tokenizer_reads_no_tensor(make_hf_llama_checkpoint: Callable[..., Path],
                                        tiny_tokenizer: Tokenizer) -> None:
    """`load_tokenizer` of a checkpoint without its weight files still gives the config,
    tokenizer and chat template: it never opens a tensor file."""
    directory = make_hf_llama_checkpoint()
    tiny_tokenizer.save(directory / "tokenizer.json")
    (directory / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (directory / "model.safetensors").unlink()
    loaded = load_tokenizer(str(directory))
    assert (loaded.config.hidden_size, loaded.config.name) == (64, directory.name)
    assert loaded.tokenizer is not None
    assert loaded.chat_template == "{{ messages[0].content }}"
    assert model_config(str(directory)) == loaded.config


def test_the_front_door_loads_no_weights(make_hf_llama_checkpoint: Callable[..., Path],
                                         tiny_tokenizer: Tokenizer) -> None:
    """`make_front_door` needs the tokenizer and template only: a checkpoint directory without
    weights serves (the nodes read the weights, not the front door)."""
    from disagg.server.http_config import HTTPConfig
    from disagg.server.launch import make_front_door

    directory = make_hf_llama_checkpoint()
    tiny_tokenizer.save(directory / "tokenizer.json")
    (directory / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (directory / "model.safetensors").unlink()
    router = SimpleNamespace(events=queue.Queue(), close=lambda: None)  # no decoder to reach
    front_door = make_front_door(str(directory), router, [], HTTPConfig())  # type: ignore[arg-type]
    try:
        assert front_door.model.vocab_size == 256
        assert front_door.tokenizer is not None
        assert front_door.chat_template is not None
        assert front_door.guides is not None
    finally:
        front_door.client.close()
        front_door.executor.shutdown()


def test_an_unsupported_architecture_is_one_cli_line(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`disagg generate --model <a GPT-2 checkpoint>`: exit code 2 and one line on stderr
    naming what the checkpoint is and what is supported."""
    from disagg.apps.cli import main

    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256,
        "n_embd": 64, "n_layer": 2, "n_head": 4}))
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(directory), "--prompt-token-ids", "1,2,3"])
    _, err = capsys.readouterr()
    assert info.value.code == 2
    assert err.count("\n") == 1
    assert err.startswith("error:")
    assert "'gpt2'" in err
    assert "GPT2LMHeadModel" in err
    assert all(name in err for name in ARCHITECTURES)  # every supported architectures value
