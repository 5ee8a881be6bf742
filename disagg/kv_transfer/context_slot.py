"""The last-token handoff: what the prefiller computes and what it ships besides pages (S4a, S8).

The prefill covers every prompt token but the last, so the prefiller never samples; the
decoder runs the last prompt token as an ordinary decode step, which yields the first output
token. The hidden state and logits of the last prefilled position travel by RDMA write into a
pre-allocated context slot on the decoder, for speculative decoding or MTP heads to start from.
The slot also carries the KV checksum and the request's nonce: a slot nobody wrote (zeros), or
one left from another request, never passes the decoder's check (S5, issue 15).

The decoder's last slot is its proof slot (S5): at handshake the prefiller writes a random
nonce there, split into one share per endpoint of the decoder, and accepts the decoder only
once it echoes the nonce (`HelloProof`). Only a process that can read the memory the Hello's
descriptors name can answer, so a Hello carrying another decoder's descriptors gets nowhere.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import reduce
from operator import xor

import torch

from disagg.config import ModelConfig
from disagg.errors import RequestError
from disagg.kv_transfer.messages import Hello, HelloProof
from disagg.kv_transfer.transfer_context import DecoderPeer
from transfer_core.engine import TransferEngine
from transfer_core.errors import PeerError, TransferError, TransferTimeoutError
from transfer_core.memory import EngineAddress, MemoryRegionDescriptor

logger = logging.getLogger(__name__)
CONTEXT_DTYPE = torch.float32
PROOF_TIMEOUT_S = 10.0  # for a proof write to complete, and for the decoder to see it land


def prefill_token_ids(prompt_token_ids: list[int]) -> list[int]:
    """The tokens a prefiller computes: all but the last."""
    return prompt_token_ids[:-1]


# A float64 KV checksum and the request's 64-bit nonce, stored as the bits of four float32s.
CHECKSUM_NUMEL = 4


def new_nonce() -> int:
    """A random 64-bit nonce, never 0 (0 is what a slot nobody wrote holds)."""
    return secrets.randbits(64) or 1


def context_slot_numel(model: ModelConfig) -> int:
    """Values in one context slot: the hidden state, the logits, the KV checksum and nonce."""
    return model.hidden_size + model.vocab_size + CHECKSUM_NUMEL


def context_slot_nbytes(model: ModelConfig) -> int:
    """Bytes in one context slot."""
    return context_slot_numel(model) * torch.empty(0, dtype=CONTEXT_DTYPE).element_size()


def allocate_context_buffer(model: ModelConfig, num_slots: int) -> torch.Tensor:
    """``[num_slots, hidden_size + vocab_size + 4]`` zeros, to be registered for RDMA."""
    return torch.zeros((num_slots, context_slot_numel(model)), dtype=CONTEXT_DTYPE)


def _put_u64(values: torch.Tensor, value: int) -> None:
    """Store a 64-bit unsigned `value` as the bits of two float32 `values` (any alignment)."""
    signed = value - (1 << 64) if value >= 1 << 63 else value
    values.view(torch.int32).copy_(torch.tensor([signed], dtype=torch.int64).view(torch.int32))


def _get_u64(values: torch.Tensor) -> int:
    """The 64-bit unsigned value `_put_u64` stored in two float32 `values`."""
    return int(values.view(torch.int32).clone().view(torch.int64)[0]) % (1 << 64)


def pack_context(slot: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor,
                 checksum: float = 0.0, nonce: int = 0) -> None:
    """Write ``[hidden_size]`` hidden state, ``[vocab_size]`` logits, the KV checksum and the
    request's nonce (from its `KVRequest`)."""
    end = hidden.numel() + logits.numel()
    slot[: hidden.numel()] = hidden.to(CONTEXT_DTYPE)
    slot[hidden.numel():end] = logits.to(CONTEXT_DTYPE)
    bits = torch.tensor([checksum], dtype=torch.float64).view(torch.int32)
    slot[end:end + 2].view(torch.int32).copy_(bits)
    _put_u64(slot[end + 2:end + CHECKSUM_NUMEL], nonce)


def unpack_context(slot: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden state, logits) views of one slot."""
    return slot[: model.hidden_size], slot[model.hidden_size:model.hidden_size + model.vocab_size]


def context_checksum(slot: torch.Tensor, model: ModelConfig) -> float:
    """The KV checksum the prefiller packed into `slot`."""
    start = model.hidden_size + model.vocab_size
    bits = slot[start:start + 2].view(torch.int32).clone()
    return float(bits.view(torch.float64)[0])


def context_nonce(slot: torch.Tensor, model: ModelConfig) -> int:
    """The request nonce the prefiller packed into `slot` (0 in a slot nobody wrote)."""
    start = model.hidden_size + model.vocab_size + 2
    return _get_u64(slot[start:start + 2])


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


def check_bound(hello: Hello) -> None:
    """Every region a decoder's Hello names must live at the engine address it gives, the one
    its proof is written to; a Hello mixing in another engine's regions is a `RequestError`.
    A rank's KV region may name only some of the endpoints (that rank's NICs, S5b): the proof
    covers every endpoint of the address, so any of them is the decoder's."""
    endpoints = set(EngineAddress.from_bytes(hello.engine_address).domains)
    named = [hello.context_descriptor, *hello.kv_descriptors]
    named += [hello.draft_kv_descriptor] if hello.draft_kv_descriptor else []
    for raw in named:
        descriptor = MemoryRegionDescriptor.from_bytes(raw)
        if not {address for address, _ in descriptor.domains} <= endpoints:
            raise RequestError(f"decoder {hello.node_id}: region {descriptor.name!r} is not at "
                               "the engine address of its Hello")


def clear_proof(context: torch.Tensor) -> None:
    """Decoder, before each Hello: zero the proof slot (the last one of its `context` buffer),
    so that only the coming proof reads back."""
    context[-1].zero_()


def read_proof(context: torch.Tensor, num_shares: int,
               timeout_s: float = PROOF_TIMEOUT_S) -> HelloProof:
    """Decoder, after HelloAck: its answer, the nonce the prefiller wrote into the proof slot
    of `context`: the XOR of `num_shares` shares (one per endpoint of this decoder's engine),
    once all have landed: non-zero and the same in two reads a millisecond apart.

    Raises `TransferTimeoutError` if they have not after `timeout_s`."""
    deadline, previous = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        shares = [_get_u64(context[-1, 2 * p:2 * p + 2]) for p in range(num_shares)]
        if all(shares) and shares == previous:
            return HelloProof(reduce(xor, shares))
        previous = shares
        time.sleep(0.001)
    raise TransferTimeoutError(f"no ownership proof landed in this decoder's proof slot within "
                               f"{timeout_s:g} s")


class ContextSlots:
    """The prefiller's registered context slots, packed then written one per request (S4a),
    and the source of handshake proofs (`write_proof`).

    A slot is taken before packing and freed when its write completed (on another thread):
    `take` waits up to `timeout_s` for one. Peers never write here: the slots are registered
    without remote write.
    """

    def __init__(self, transfer: TransferEngine, model: ModelConfig, num_slots: int) -> None:
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

    def write_proof(self, hello: Hello, peer: MemoryRegionDescriptor,
                    timeout_s: float = PROOF_TIMEOUT_S) -> int:
        """Write a fresh random nonce into the proof slot (the last) of a decoder's context
        region `peer`, one share per endpoint of the decoder and through that endpoint (their
        XOR is the nonce), and wait until every write completed; returns the nonce it must
        echo. A process owning only some of the endpoints misses a share, and every region of
        the `hello` must be at those endpoints (`check_bound`). Raises `PeerError`,
        `TransferTimeoutError`, or `RequestError` (regions elsewhere, or no slot but one)."""
        check_bound(hello)
        peer_slot = peer.length // self.slot_nbytes - 1
        if peer_slot < 1:
            raise RequestError(f"context region {peer.name!r} of {peer.length} bytes holds no "
                               f"slot besides the proof slot ({self.slot_nbytes} bytes each)")
        shares = [new_nonce() for _ in peer.domains]
        nonce = reduce(xor, shares)
        try:
            slot, n = self.take(timeout_s), self.slot_nbytes
        except queue.Empty:
            raise TransferTimeoutError("no free context slot for a proof write") from None
        lock, finished, left = threading.Lock(), threading.Event(), [len(shares)]
        errors: list[BaseException] = []

        def done(error: BaseException | None = None) -> None:
            with lock:
                if error is not None:
                    errors.append(error)
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

        try:
            for p, share in enumerate(shares):
                _put_u64(self.buffer[slot, 2 * p:2 * p + 2], share)
            for p in range(len(shares)):
                # A descriptor of endpoint p alone: whichever domain of ours posts it, the
                # write goes to that endpoint.
                endpoint = replace(peer, domains=(peer.domains[p],))
                try:
                    self._transfer.submit_write(self.region, slot * n + 8 * p, 8, None, endpoint,
                                                peer_slot * n + 8 * p, on_done=done,
                                                on_error=done, timeout_s=timeout_s)
                except (TransferError, ValueError) as error:
                    done(error)
            if not finished.wait(timeout_s + 5.0):  # the engine fails ops at their deadline
                raise TransferTimeoutError(f"proof writes to {peer.name!r}: no completion")
        finally:
            self._free.put(slot)  # even after a timeout: a late read of it sends a bad share
        if errors:
            raise PeerError(f"proof write to region {peer.name!r} failed: {errors[0]}")
        return nonce

    @staticmethod
    def check_proof(peer: DecoderPeer, proof: HelloProof) -> None:
        """The decoder echoed the nonce `write_proof` wrote into its proof slot (`peer.proof`),
        so it reads the memory its Hello names: mark it proven. Else `RequestError`."""
        if peer.proven or proof.nonce != peer.proof:
            raise RequestError(f"decoder {peer.peer_id}: wrong ownership proof (it cannot read "
                               "the memory its Hello names)")
        peer.proven = True

    def close(self) -> None:
        """Unregister the slots (after the transfer engine drained)."""
        self._transfer.unregister_memory(self.region)
