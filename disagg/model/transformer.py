"""A decoder-only transformer in pure PyTorch that reads and writes a paged KV cache (S3b).

Pre-norm layers of attention and a feed-forward, each with a residual connection; embeddings
tied or not. Which attention (`self_attention.py`, or MLA's `latent_attention.py`) and which
feed-forward (`mlp.py`, or a mixture of experts, `moe.py`) a layer runs comes from its
`ModelConfig`. Parameter names follow Hugging Face's `*ForCausalLM` without the leading
``model.`` so checkpoints load without renaming. Tokens of several requests
are packed on one axis (no padding); `AttentionMetadata` says which rows belong to whom.

After each layer's attention output projection the forward bumps a `LayerCounter` (a tensor
op, not a Python callback), so a captured CUDA graph still drives layer-by-layer transfers.

Given a `TPShard` the model is one tensor-parallel rank's part (`tensor_parallel.py`): its
query and KV heads, its slice of the MLP, and an all-reduce after o_proj and after down_proj.
Only the leader is built with a real counter, and it bumps after the o_proj all-reduce (S3c).

A batch of decodes of a Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE model on a CPU with AVX-512
runs the loop's kernels in one C call instead (`decode_layers.py`, X8e), with the loop's bits.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

import torch
from torch import nn

from disagg.model import decode_layers, layer_weights
from disagg.model.attention import AttentionMetadata
from disagg.model.kv_cache import KVCache
from disagg.model.layer_counter import LayerCounter, NullLayerCounter
from disagg.model.linear import Linear, linear
from disagg.model.mlp import MLP
from disagg.model.norms import RMSNorm
from disagg.model.rope import RotaryEmbedding
from disagg.model.self_attention import Attention
from disagg.model.tensor_parallel import Cut, TPShard
from disagg.model_config import ModelConfig


def _attention(config: ModelConfig, shard: TPShard) -> nn.Module:
    if config.mla is not None:
        from disagg.model.latent_attention import LatentAttention
        return LatentAttention(config, shard)
    return Attention(config, shard)


def _feed_forward(config: ModelConfig, shard: TPShard, layer_idx: int) -> nn.Module:
    if config.moe is not None and config.moe.is_sparse(layer_idx):
        from disagg.model.moe import MoE
        return MoE(config, shard)
    return MLP(config.hidden_size, config.intermediate_size, shard)


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward, each with a residual connection."""

    def __init__(self, config: ModelConfig, shard: TPShard, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _attention(config, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _feed_forward(config, shard, layer_idx)


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if it is contiguous and the whole of its storage, else a copy that is."""
    whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes
    return tensor if whole else tensor.contiguous().clone()


def _embedding(config: ModelConfig) -> nn.Embedding:
    # nn.Embedding's own N(0, 1) init, except on the meta device (a model built for its shapes,
    # `weight_shards`, or to be handed its weights, `Transformer.holding`): there it would run
    # torch's Python reference kernels, whose first use imports torch._dynamo, a second of
    # every process's start.
    weight = torch.empty(config.vocab_size, config.hidden_size)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding.from_pretrained(weight, freeze=False)


class Transformer(nn.Module):
    """The whole decoder: embeddings, layers, final norm, LM head."""

    def __init__(self, config: ModelConfig, layer_counter: LayerCounter | None = None,
                 shard: TPShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard or TPShard.single(config.num_kv_heads)
        if layer_counter is not None and not self.shard.is_leader:
            raise ValueError(f"only the leader bumps the layer counter (S3c), not rank "
                             f"{self.shard.rank}")
        self.embed_tokens = _embedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, self.shard, i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, bias=False))
        self.rope = RotaryEmbedding.for_model(config)
        # Bumped after each layer's attention (S3b): a prefiller's builder passes the counter
        # its poller watches; everyone else bumps nothing.
        self.layer_counter: LayerCounter = layer_counter or NullLayerCounter()
        # Whether a batch of decodes may run every layer in one C call (X8e).
        self.layers_in_c = decode_layers.layers_fit(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor:
        """Run `input_ids` ``[num_tokens]`` through every layer; returns the final-norm hidden
        states ``[num_tokens, hidden_size]`` and leaves each layer's K/V in `kv_cache`. With
        `num_layers`, only the first ones run: an early-exit draft (decoders only, S8)."""
        h = self.embed_tokens(input_ids)
        angles = self.rope.angles(positions, meta, h.dtype)
        if decode_layers.takes(self, h, angles, kv_cache, meta, num_layers):
            # The loop below, kernel for kernel, in one call: no Python between the kernels.
            h = decode_layers.run(self, h, angles, kv_cache, meta,
                                  len(self.layers) if num_layers is None else num_layers)
            return self.norm(h)
        # islice, not self.layers[:num_layers]: slicing builds a new ModuleList every forward.
        for layer_idx, layer in enumerate(islice(self.layers, num_layers)):
            attn_out = layer.self_attn(layer.input_layernorm(h), angles, kv_cache, layer_idx,
                                       meta)
            # This layer's K/V are in the cache now: let the messenger ship them (S3b).
            self.layer_counter.bump()
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> ``[num_rows, vocab_size]``."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor],
               recurse: bool = True) -> Transformer:
        # .to(), .float(), .bfloat16() ... give the parameters new storage: the decode step's
        # table of weight addresses must be built again (X8e).
        layer_weights.forget(self)
        return super()._apply(fn, recurse)

    def tp_cuts(self) -> dict[str, Cut]:
        """Full parameter name -> the slice this rank holds, for every weight TP splits (the
        rest, norms, embeddings, routers, are whole on every rank)."""
        cuts = {}
        for prefix, module in self.named_modules():
            own = getattr(module, "tp_cuts", None)
            if own is not None and module is not self:
                cuts |= {f"{prefix}.{name}": cut for name, cut in own().items()}
        return cuts

    @classmethod
    def holding(cls, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                layer_counter: LayerCounter | None = None,
                shard: TPShard | None = None) -> Transformer:
        """A model whose parameters are `state_dict`'s tensors (names as in `load_weights`),
        taken as they are where a tensor is the whole of its storage, else copied (a TP slice
        would keep its full weight alive). Built on the meta device: no weight is drawn at
        random only to be overwritten (SmolLM2's took 0.66 s of a node's start)."""
        with torch.device("meta"):
            model = cls(config, layer_counter, shard)
        model.load_weights({name: _owning(tensor) for name, tensor in state_dict.items()},
                           assign=True)
        left = [name for name, t in (*model.named_parameters(), *model.named_buffers())
                if t.is_meta]
        if left:
            raise ValueError(f"state dict mismatch: nothing loaded into {left[:5]}")
        return model

    def load_weights(self, state_dict: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Copy a Hugging Face style state dict (names without ``model.``) into the model (with
        `assign`, its tensors become the parameters)."""
        if assign:
            layer_weights.forget(self)  # the parameters become new tensors
        missing, unexpected = self.load_state_dict(state_dict, strict=False, assign=assign)
        missing = [name for name in missing if not name.startswith("rope.")]
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
