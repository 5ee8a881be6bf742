"""Draft models for speculative decoding: an MTP head and a self-speculative early exit (S8).

`MTPHead` is one transformer block in the style of DeepSeek-V3's multi-token prediction
module: at position t it takes the target's hidden state at t and the embedding of token t+1,
and predicts token t+2 through the target's own LM head (embeddings and head are shared). Its
attention keeps a KV cache of its own: a one-layer paged cache indexed by the request's page
ids, so it grows, rolls back and is freed with the target's pages at no extra bookkeeping.
The early-exit draft is the target's first `draft_layers` layers, final norm and LM head: no
weights of its own. Both only read and write pages; `disagg/speculative/speculator.py` decides what
to draft.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from disagg.config import CacheConfig, ModelConfig
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.kv_cache import KVCache, PagedKVCache
from disagg.model.linear import Linear
from disagg.model.norms import RMSNorm
from disagg.model.precision import cast_model
from disagg.model.tensor_parallel import TPShard
from disagg.model.transformer import DecoderLayer, Transformer

MTP_INIT_STD = 0.02
MTP_SEED = 0  # every node builds the same random head from it: nothing to ship or agree on


@dataclass(frozen=True, slots=True)
class Span:
    """Positions `[start, start + num_tokens)` of one request, whose K/V go to `page_ids`."""

    page_ids: list[int]
    start: int
    num_tokens: int


def span_metadata(spans: list[Span], page_size: int, device: torch.device
                  ) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions ``[num_tokens]`` and attention metadata for spans packed on one axis: the same
    packing `ModelRunner.prepare` does for a batch, for forwards that are not a batch."""
    sequences, start = [], 0
    for span in spans:
        pages = torch.tensor(span.page_ids, dtype=torch.int64, device=device)
        sequences.append(SequenceSlice(start, span.num_tokens, span.start, pages))
        start += span.num_tokens
    positions = torch.cat([torch.arange(s.start, s.start + s.num_tokens) for s in spans])
    positions = positions.to(device)
    slot_pages = torch.cat([seq.page_ids[positions[seq.query_start:seq.query_start
                                                   + seq.query_len] // page_size]
                            for seq in sequences])
    meta = AttentionMetadata(slot_page_ids=slot_pages, slot_offsets=positions % page_size,
                             sequences=sequences)
    if len(spans) > 1 and all(s.num_tokens == 1 for s in spans):
        # One padded call for a step of single tokens; padding is masked by kv_len.
        max_pages = max(-(-s.kv_len // page_size) for s in sequences)
        table = torch.zeros((len(spans), max_pages), dtype=torch.int64, device=device)
        for row, seq in enumerate(sequences):
            used = -(-seq.kv_len // page_size)
            table[row, :used] = seq.page_ids[:used]
        meta.decode_page_table = table
        meta.decode_kv_lens = torch.tensor([s.kv_len for s in sequences], device=device)
    return positions, meta


class MTPHead(nn.Module):
    """DeepSeek-V3 style MTP module: ``eh_proj([enorm(embed(t+1)); hnorm(h_t)])``, one decoder
    block over its own one-layer cache, then a norm before the target's shared LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = DecoderLayer(config, TPShard.single(config.num_kv_heads))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, target: Transformer, hidden: torch.Tensor, next_token_ids: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` ``[num_tokens, hidden_size]`` (the target's at each position, or this head's
        own output when drafting further) and the ids of the tokens that follow them
        ``[num_tokens]``. Returns the block's output (the input of a further draft step) and
        its normed form (for `target.compute_logits`), both ``[num_tokens, hidden_size]``."""
        x = torch.cat([self.enorm(target.embed_tokens(next_token_ids)), self.hnorm(hidden)], -1)
        x = self.eh_proj(x)
        block = self.block
        angles = target.rope.angles(positions, meta, x.dtype)
        x = x + block.self_attn(block.input_layernorm(x), angles, kv_cache, 0, meta)
        x = x + block.mlp(block.post_attention_layernorm(x))
        return x, self.norm(x)


def build_mtp_head(config: ModelConfig, seed: int = MTP_SEED,
                   dtype: torch.dtype = torch.float32) -> MTPHead:
    """A random-init MTP head, bit-identical for the same `(config, seed)` on every machine
    (so a prefiller and its decoders agree without shipping weights), in the target's `dtype`
    (drawn in float32, then cast). Untrained: it shows the mechanism; load trained weights
    with `load_state_dict` to make it accept tokens."""
    head = MTPHead(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(head.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * MTP_INIT_STD)
    return cast_model(head, dtype).eval()


def mtp_kv_cache(config: ModelConfig, cache: CacheConfig, device: str | torch.device
                 ) -> PagedKVCache:
    """The MTP head's own cache: one layer, the target's page geometry and page count, so a
    request's page ids index it too (its KV pages are the same ids in a separate buffer)."""
    return PagedKVCache(replace(config, num_layers=1), cache, device)
