"""The last-token handoff: what the prefiller computes and what it ships besides pages (S4a, S8).

The prefill covers every prompt token but the last, so the prefiller never samples; the
decoder runs the last prompt token as an ordinary decode step, which yields the first output
token. The hidden state and logits of the last prefilled position travel by RDMA write into a
pre-allocated context slot on the decoder, for speculative decoding or MTP heads to start from.
"""

from __future__ import annotations

import torch

from disagg.config import ModelConfig

CONTEXT_DTYPE = torch.float32


def prefill_token_ids(prompt_token_ids: list[int]) -> list[int]:
    """The tokens a prefiller computes: all but the last."""
    return prompt_token_ids[:-1]


def context_slot_numel(model: ModelConfig) -> int:
    """Values in one context slot: the hidden state, then the logits."""
    return model.hidden_size + model.vocab_size


def context_slot_nbytes(model: ModelConfig) -> int:
    """Bytes in one context slot."""
    return context_slot_numel(model) * torch.empty(0, dtype=CONTEXT_DTYPE).element_size()


def allocate_context_buffer(model: ModelConfig, num_slots: int) -> torch.Tensor:
    """``[num_slots, hidden_size + vocab_size]`` zeros, to be registered for RDMA."""
    return torch.zeros((num_slots, context_slot_numel(model)), dtype=CONTEXT_DTYPE)


def pack_context(slot: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """Write ``[hidden_size]`` hidden state and ``[vocab_size]`` logits into one slot."""
    slot[: hidden.numel()] = hidden.to(CONTEXT_DTYPE)
    slot[hidden.numel():] = logits.to(CONTEXT_DTYPE)


def unpack_context(slot: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden state, logits) views of one slot."""
    return slot[: model.hidden_size], slot[model.hidden_size:]
