"""The last-token handoff: what the prefiller computes and what it ships besides pages (S4a, S8).

The prefill covers every prompt token but the last, so the prefiller never samples; the
decoder runs the last prompt token as an ordinary decode step, which yields the first output
token. The hidden state of the last prefilled position travels by RDMA write into a
pre-allocated context slot on the decoder, for an MTP head to start from. Its logits would only
predict the prompt's known last token, so the prefiller never computes them: its forward skips
the LM head (a SmolLM2 float32 prefill's largest matrix) and the slot is hidden_size values
instead of hidden_size + vocab_size.
The slot also carries the KV checksum and the request's nonce: a slot nobody wrote (zeros), or
one left from another request, never passes the decoder's check (S5).

Both sides' slots are here: the prefiller's registered source slots (`ContextSlots`), packed
then written one per request, and the decoder's registered landing slots (`LandingSlots`), one
taken per request waiting for KV. The decoder's last slot is its proof slot, written once per
handshake (`handshake.py`, S5).
"""

from __future__ import annotations

import logging
import queue
import secrets
from collections.abc import Callable

import torch

from disagg.config import ModelConfig
from transfer_core.errors import TransferError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)
CONTEXT_DTYPE = torch.float32


def prefill_token_ids(prompt_token_ids: list[int]) -> list[int]:
    """The tokens a prefiller computes: all but the last."""
    return prompt_token_ids[:-1]


# A float64 KV checksum and the request's 64-bit nonce, stored as the bits of four float32s.
CHECKSUM_NUMEL = 4


def new_nonce() -> int:
    """A random 64-bit nonce, never 0 (0 is what a slot nobody wrote holds)."""
    return secrets.randbits(64) or 1


def context_slot_numel(model: ModelConfig) -> int:
    """Values in one context slot: the hidden state, the KV checksum and the nonce."""
    return model.hidden_size + CHECKSUM_NUMEL


def context_slot_nbytes(model: ModelConfig) -> int:
    """Bytes in one context slot."""
    return context_slot_numel(model) * torch.empty(0, dtype=CONTEXT_DTYPE).element_size()


def allocate_context_buffer(model: ModelConfig, num_slots: int) -> torch.Tensor:
    """``[num_slots, hidden_size + 4]`` zeros, to be registered for RDMA."""
    return torch.zeros((num_slots, context_slot_numel(model)), dtype=CONTEXT_DTYPE)


def put_u64(values: torch.Tensor, value: int) -> None:
    """Store a 64-bit unsigned `value` as the bits of two float32 `values` (any alignment)."""
    signed = value - (1 << 64) if value >= 1 << 63 else value
    values.view(torch.int32).copy_(torch.tensor([signed], dtype=torch.int64).view(torch.int32))


def get_u64(values: torch.Tensor) -> int:
    """The 64-bit unsigned value `put_u64` stored in two float32 `values`."""
    return int(values.view(torch.int32).clone().view(torch.int64)[0]) % (1 << 64)


def pack_context(slot: torch.Tensor, hidden: torch.Tensor, checksum: float = 0.0,
                 nonce: int = 0) -> None:
    """Write the ``[hidden_size]`` hidden state, the KV checksum and the request's nonce (from
    its `KVRequest`)."""
    end = hidden.numel()
    slot[:end] = hidden.to(CONTEXT_DTYPE)
    bits = torch.tensor([checksum], dtype=torch.float64).view(torch.int32)
    slot[end:end + 2].view(torch.int32).copy_(bits)
    put_u64(slot[end + 2:end + CHECKSUM_NUMEL], nonce)


def unpack_context(slot: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """The hidden state's view in one slot."""
    return slot[: model.hidden_size]


def context_checksum(slot: torch.Tensor, model: ModelConfig) -> float:
    """The KV checksum the prefiller packed into `slot`."""
    start = model.hidden_size
    bits = slot[start:start + 2].view(torch.int32).clone()
    return float(bits.view(torch.float64)[0])


def context_nonce(slot: torch.Tensor, model: ModelConfig) -> int:
    """The request nonce the prefiller packed into `slot` (0 in a slot nobody wrote)."""
    start = model.hidden_size + 2
    return get_u64(slot[start:start + 2])


def slot_matches(slot: torch.Tensor, model: ModelConfig, nonce: int, checksum: float,
                 request_id: str) -> bool:
    """Decoder: whether a request's context `slot` carries the `nonce` it sent with the request
    (a slot nobody wrote holds 0, another request's its own) and the KV `checksum` of what
    landed. Zero pages under a zero slot sum to a zero checksum: the nonce is what fails them."""
    if context_nonce(slot, model) != nonce:
        logger.warning("request %s: its context slot does not hold its nonce", request_id)
        return False
    expected = context_checksum(slot, model)
    if checksum != expected:
        logger.warning("request %s: KV checksum %r, prefiller sent %r", request_id, checksum,
                       expected)
    return checksum == expected


class ContextSlots:
    """The prefiller's registered context slots, packed then written one per request (S4a);
    a handshake's proof borrows one too (`handshake.write_proof`).

    A slot is taken before packing and freed when its write completed (on another thread):
    `take` waits up to `timeout_s` for one. Peers never write here: the slots are registered
    without remote write.
    """

    def __init__(self, transfer: Transport, model: ModelConfig, num_slots: int) -> None:
        self.buffer = allocate_context_buffer(model, num_slots)
        self.region, _ = transfer.register_memory(self.buffer, name="prefill-ctx",
                                                  remote_write=False)
        self.slot_nbytes = context_slot_nbytes(model)
        self._transfer = transfer
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(num_slots):
            self._free.put(slot)

    def take(self, timeout_s: float) -> int:
        """A free slot (raises `queue.Empty` after `timeout_s`)."""
        return self._free.get(timeout=timeout_s)

    def give_back(self, slot: int) -> None:
        """Free a slot taken with `take` (its write completed, or was never posted)."""
        self._free.put(slot)

    def post(self, slot: int, imm: int, peer: MemoryRegionDescriptor, peer_slot: int,
             done: Callable[[BaseException | None], None]) -> bool:
        """Write `slot` into the peer's `peer_slot` with `imm`; `done(error or None)` once, when
        the slot is free again. False if the write could not even be posted."""

        def finish(error: BaseException | None) -> None:
            self.give_back(slot)
            done(error)

        n = self.slot_nbytes
        try:
            self._transfer.post_write(self.region, slot * n, n, imm, peer, peer_slot * n,
                                        on_done=lambda: finish(None), on_error=finish)
        except (TransferError, ValueError) as error:
            finish(error)
            return False
        return True

    def close(self) -> None:
        """Unregister the slots (after the transfer engine drained)."""
        self._transfer.unregister_memory(self.region)


class LandingSlots:
    """The decoder's registered context slots, which prefillers write (S4a): one is taken per
    request asking for KV and given back when the request leaves; the last is the proof slot
    of every handshake and is never taken."""

    def __init__(self, transfer: Transport, model: ModelConfig, num_slots: int) -> None:
        self.buffer = allocate_context_buffer(model, num_slots)
        self.region: MemoryRegion
        self.region, self.descriptor = transfer.register_memory(
            self.buffer, name="decode-ctx", remote_write=True)
        self._transfer = transfer
        self._free = list(range(num_slots - 1))

    def __bool__(self) -> bool:
        """Whether a slot is free."""
        return bool(self._free)

    def take(self) -> int:
        """A free slot (check `bool(self)` first)."""
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        """The request holding `slot` left: no write can land in it any more."""
        self._free.append(slot)

    def close(self) -> None:
        """Unregister the slots (after the transfer engine drained)."""
        self._transfer.unregister_memory(self.region)
