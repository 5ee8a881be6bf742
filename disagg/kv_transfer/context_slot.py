"""The last-token handoff: what the prefiller computes and what it ships besides pages (S4a, S8).

The prefill covers every prompt token but the last, so the prefiller never samples; the
decoder runs the last prompt token as an ordinary decode step, which yields the first output
token. The hidden state and logits of the last prefilled position travel by RDMA write into a
pre-allocated context slot on the decoder, for speculative decoding or MTP heads to start from.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

import torch

from disagg.config import ModelConfig
from disagg.model.kv_cache import KVCache
from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError
from transfer_core.memory import MemoryRegionDescriptor

CONTEXT_DTYPE = torch.float32


def prefill_token_ids(prompt_token_ids: list[int]) -> list[int]:
    """The tokens a prefiller computes: all but the last."""
    return prompt_token_ids[:-1]


CHECKSUM_NUMEL = 2  # a float64 KV checksum, stored as the bits of two float32 values


def context_slot_numel(model: ModelConfig) -> int:
    """Values in one context slot: the hidden state, the logits, then the KV checksum."""
    return model.hidden_size + model.vocab_size + CHECKSUM_NUMEL


def context_slot_nbytes(model: ModelConfig) -> int:
    """Bytes in one context slot."""
    return context_slot_numel(model) * torch.empty(0, dtype=CONTEXT_DTYPE).element_size()


def allocate_context_buffer(model: ModelConfig, num_slots: int) -> torch.Tensor:
    """``[num_slots, hidden_size + vocab_size + 2]`` zeros, to be registered for RDMA."""
    return torch.zeros((num_slots, context_slot_numel(model)), dtype=CONTEXT_DTYPE)


def pack_context(slot: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                 checksum: float = 0.0) -> None:
    """Write ``[hidden_size]`` hidden state, ``[vocab_size]`` logits and the KV checksum."""
    end = hidden.numel() + logits.numel()
    slot[: hidden.numel()] = hidden.to(CONTEXT_DTYPE)
    slot[hidden.numel():end] = logits.to(CONTEXT_DTYPE)
    bits = torch.tensor([checksum], dtype=torch.float64).view(torch.int32)
    slot[end:end + CHECKSUM_NUMEL].view(torch.int32).copy_(bits)


def unpack_context(slot: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden state, logits) views of one slot."""
    return slot[: model.hidden_size], slot[model.hidden_size:model.hidden_size + model.vocab_size]


def context_checksum(slot: torch.Tensor, model: ModelConfig) -> float:
    """The KV checksum the prefiller packed into `slot`."""
    start = model.hidden_size + model.vocab_size
    bits = slot[start:start + CHECKSUM_NUMEL].view(torch.int32).clone()
    return float(bits.view(torch.float64)[0])


def kv_checksum(kv_cache: KVCache, page_ids: list[int], num_tokens: int,
                first_page: int = 0) -> float:
    """A float64 sum of every K/V value of the first `num_tokens` tokens, all layers and heads,
    leaving out the pages before `first_page` (those a decoder held already: prefix caching).

    It depends only on the logical values, not on the layout or the sharding, so a prefiller
    and a decoder holding the same KV compute the same number: the decoder's check that the
    counter did not fire early (a duplicated immediate) or over corrupted pages (issue 8).
    """
    pages = torch.tensor(page_ids[first_page:], dtype=torch.int64, device=kv_cache.device)
    num_tokens -= first_page * kv_cache.page_size
    total = torch.zeros((), dtype=torch.float64, device=kv_cache.device)  # one sync, at the end
    for layer in range(kv_cache.num_layers):
        k, v = kv_cache.gather(layer, pages, num_tokens)
        total += k.contiguous().double().sum() + v.contiguous().double().sum()
    return float(total)


class ContextSlots:
    """The prefiller's registered context slots, packed then written one per request (S4a).

    A slot is taken before packing and freed when its write completed (on another thread):
    `take` waits up to `timeout_s` for one.
    """

    def __init__(self, transfer: TransferEngine, model: ModelConfig, num_slots: int) -> None:
        self.buffer = allocate_context_buffer(model, num_slots)
        self.region, _ = transfer.register_memory(self.buffer, name="prefill-ctx")
        self.slot_nbytes = context_slot_nbytes(model)
        self._transfer = transfer
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(num_slots):
            self._free.put(slot)

    def take(self, timeout_s: float) -> int:
        """A free slot (raises `queue.Empty` after `timeout_s`)."""
        return self._free.get(timeout=timeout_s)

    def submit(self, slot: int, imm: int, peer: MemoryRegionDescriptor, peer_slot: int,
               done: Callable[[BaseException | None], None]) -> bool:
        """Write `slot` into the peer's `peer_slot` with `imm`; `done(error or None)` once, when
        the slot is free again. False if the write could not even be posted."""

        def finish(error: BaseException | None) -> None:
            self._free.put(slot)
            done(error)

        n = self.slot_nbytes
        try:
            self._transfer.submit_write(self.region, slot * n, n, imm, peer, peer_slot * n,
                                        on_done=lambda: finish(None), on_error=finish)
        except (TransferError, ValueError) as error:
            finish(error)
            return False
        return True

    def close(self) -> None:
        """Unregister the slots (after the transfer engine drained)."""
        self._transfer.unregister_memory(self.region)
