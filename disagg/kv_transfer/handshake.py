"""Both sides of the messengers' handshake (S5): Hello, the model fingerprint, the ownership
proof.

1. The decoder zeroes its proof slot and sends `Hello` (`decoder_hello`): its model fingerprint,
   cache geometry, fabric address and the descriptors of the memory prefillers write to.
2. The prefiller compares what must match (`hello_mismatches`: the fingerprint, dtype, page
   size, layout, shapes; a refusal names the decoder's own values only), checks the regions
   add up and live at the Hello's engine address (`parse_peer`, `check_bound`), and writes a
   random nonce into the decoder's proof slot, one share per endpoint (`write_proof`). It
   answers `HelloAck` (its sharding, so both sides count the same writes, S6b).
3. The decoder reads the shares back (`read_proof`) and echoes their XOR as `HelloProof`; only
   a process that reads the memory its Hello named can. The prefiller checks it
   (`check_proof`) and takes the decoder's requests from then on.
`shake_hands` is the decoder's whole side over one control channel.
"""

from __future__ import annotations

import queue
import select
import threading
import time
from dataclasses import replace
from functools import reduce
from operator import xor

import torch

from disagg.config import ModelConfig
from disagg.control.channel import Channel
from disagg.control.messages import Reject
from disagg.errors import PeerClosedError, PeerMismatchError, ProtocolError, RequestError
from disagg.kv_transfer.context_slot import (
    ContextSlots,
    context_slot_nbytes,
    get_u64,
    new_nonce,
    put_u64,
)
from disagg.kv_transfer.decoder_peer import DecoderPeer
from disagg.kv_transfer.messages import Hello, HelloAck, HelloProof
from disagg.model.kv_cache import KVCache
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding
from transfer_core.errors import PeerError, TransferError, TransferTimeoutError
from transfer_core.memory import EngineAddress, MemoryRegionDescriptor
from transfer_core.memory_paths import MEMORY_PATH_KINDS
from transfer_core.transport import Transport

PROOF_TIMEOUT_S = 10.0  # for a proof write to complete, and for the decoder to see it land
ANSWER_TIMEOUT_S = 10.0  # for the prefiller's answer to Hello: a frozen one must not hold us
# What a decoder may say its KV memory path is ("": it did not say).
PEER_MEMORY_PATHS = ("", *MEMORY_PATH_KINDS)
# The fields of a Hello a prefiller must share with the decoder.
MATCHED_FIELDS = ("model", "dtype", "page_size", "kv_layout", "num_layers", "num_kv_heads",
                  "head_dim", "context_slot_nbytes")


# Decoder side.

def decoder_hello(node_id: str, fingerprint: str, config: ModelConfig, cache: KVCache,
                  engine_address: bytes, kv: list[MemoryRegionDescriptor],
                  context: MemoryRegionDescriptor, draft_kv: bytes = b"",
                  kv_memory_path: str = "") -> Hello:
    """A decoder's Hello: model, cache geometry, fabric address, descriptors."""
    return Hello(
        node_id=node_id, model=fingerprint, dtype=str(cache.dtype).removeprefix("torch."),
        page_size=cache.page_size, kv_layout=cache.kv_layout, num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        engine_address=engine_address, kv_descriptors=[d.to_bytes() for d in kv],
        context_descriptor=context.to_bytes(), context_slot_nbytes=context_slot_nbytes(config),
        tp=cache.sharding.tp, replicated_kv=cache.sharding.replicated,
        draft_kv_descriptor=draft_kv, kv_memory_path=kv_memory_path)


def shake_hands(address: str, hello: Hello, context: torch.Tensor, num_shares: int,
                timeout_s: float = ANSWER_TIMEOUT_S) -> tuple[Channel, HelloAck]:
    """Connect to the prefiller at `address` and shake hands; the proof lands in the last slot
    of `context`, in `num_shares` shares (this decoder's endpoints). The channel is closed on
    any failure (`PeerMismatchError` when the prefiller refuses us, naming why)."""
    channel = Channel.connect(address, timeout_s)
    try:
        clear_proof(context)  # only the answer to this Hello may read back
        channel.send(hello)
        if not select.select([channel.sock], [], [], timeout_s)[0]:
            raise PeerClosedError(f"prefiller {address} did not answer the handshake in "
                                  f"{timeout_s:g} s")
        reply = channel.recv()
        if isinstance(reply, Reject):
            raise PeerMismatchError(f"prefiller {address} refused this decoder: {reply.reason}")
        if not isinstance(reply, HelloAck):
            raise ProtocolError(f"prefiller {address} answered {type(reply).__name__}")
        channel.send(read_proof(context, num_shares))
    except BaseException:
        channel.close()
        raise
    return channel, reply


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
        shares = [get_u64(context[-1, 2 * p:2 * p + 2]) for p in range(num_shares)]
        if all(shares) and shares == previous:
            return HelloProof(reduce(xor, shares))
        previous = shares
        time.sleep(0.001)
    raise TransferTimeoutError(f"no ownership proof landed in this decoder's proof slot within "
                               f"{timeout_s:g} s")


# Prefiller side.

def expected_hello(node_id: str, fingerprint: str, config: ModelConfig, cache: KVCache) -> Hello:
    """The handshake fields a decoder must match (addresses and descriptors aside)."""
    return Hello(node_id, fingerprint, str(cache.dtype).removeprefix("torch."), cache.page_size,
                 cache.kv_layout, config.num_layers, config.num_kv_heads, config.head_dim, b"",
                 [], b"", context_slot_nbytes(config))


def hello_mismatches(hello: Hello, expected: Hello) -> list[str]:
    """Fields where a decoder's handshake differs from what this prefiller runs: each names
    the field and the decoder's own value, never the expected one (a stranger learns nothing
    of this prefiller from a refusal)."""
    return [f"{name}: decoder has {getattr(hello, name)!r}, not what this prefiller runs"
            for name in MATCHED_FIELDS if getattr(hello, name) != getattr(expected, name)]


def parse_peer(hello: Hello, channel: Channel, num_layers: int, geometry: PageGeometry,
               slot_nbytes: int) -> DecoderPeer:
    """A decoder's regions from its handshake; `RequestError` if they do not add up."""
    sharding = Sharding(hello.tp, hello.num_kv_heads, hello.replicated_kv)
    if len(hello.kv_descriptors) != sharding.tp:
        raise RequestError(f"decoder {hello.node_id}: {len(hello.kv_descriptors)} KV "
                           f"regions for tp={sharding.tp}")
    if hello.kv_memory_path not in PEER_MEMORY_PATHS:
        raise RequestError(f"decoder {hello.node_id}: unknown KV memory path "
                           f"{hello.kv_memory_path!r}, expected one of {PEER_MEMORY_PATHS[1:]}")
    kv = [MemoryRegionDescriptor.from_bytes(d) for d in hello.kv_descriptors]
    context = MemoryRegionDescriptor.from_bytes(hello.context_descriptor)
    page_nbytes = geometry.page_nbytes(sharding.heads_per_rank)
    layer_nbytes, rest = divmod(kv[0].length, num_layers)
    peer_pages, rest2 = divmod(layer_nbytes, page_nbytes)
    if rest or rest2 or peer_pages == 0 or any(d.length != kv[0].length for d in kv):
        raise RequestError(f"decoder {hello.node_id}: KV regions of {kv[0].length} bytes "
                           f"are not {num_layers} layers of whole {page_nbytes}-byte pages")
    return DecoderPeer(hello.node_id, channel, kv, context, sharding, peer_pages,
                       context.length // slot_nbytes, page_nbytes, layer_nbytes,
                       hello.kv_memory_path, bool(hello.draft_kv_descriptor),
                       engine_address=hello.engine_address)


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


def write_proof(slots: ContextSlots, transport: Transport, hello: Hello,
                peer: MemoryRegionDescriptor, timeout_s: float = PROOF_TIMEOUT_S) -> int:
    """Write a fresh random nonce into the proof slot (the last) of a decoder's context
    region `peer`, one share per endpoint of the decoder and through that endpoint (their
    XOR is the nonce), and wait until every write completed; returns the nonce it must
    echo. A process owning only some of the endpoints misses a share, and every region of
    the `hello` must be at those endpoints (`check_bound`). Raises `PeerError`,
    `TransferTimeoutError`, or `RequestError` (regions elsewhere, or no slot but one)."""
    check_bound(hello)
    peer_slot = peer.length // slots.slot_nbytes - 1
    if peer_slot < 1:
        raise RequestError(f"context region {peer.name!r} of {peer.length} bytes holds no "
                           f"slot besides the proof slot ({slots.slot_nbytes} bytes each)")
    shares = [new_nonce() for _ in peer.domains]
    nonce = reduce(xor, shares)
    try:
        slot, n = slots.take(timeout_s), slots.slot_nbytes
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
            put_u64(slots.buffer[slot, 2 * p:2 * p + 2], share)
        for p in range(len(shares)):
            # A descriptor of endpoint p alone: whichever domain of ours posts it, the
            # write goes to that endpoint.
            endpoint = replace(peer, domains=(peer.domains[p],))
            try:
                transport.post_write(slots.region, slot * n + 8 * p, 8, None, endpoint,
                                            peer_slot * n + 8 * p, on_done=done,
                                            on_error=done, timeout_s=timeout_s)
            except (TransferError, ValueError) as error:
                done(error)
        if not finished.wait(timeout_s + 5.0):  # the engine fails ops at their deadline
            raise TransferTimeoutError(f"proof writes to {peer.name!r}: no completion")
    finally:
        slots.give_back(slot)  # even after a timeout: a late read of it sends a bad share
    if errors:
        raise PeerError(f"proof write to region {peer.name!r} failed: {errors[0]}")
    return nonce


def check_proof(peer: DecoderPeer, proof: HelloProof) -> None:
    """The decoder echoed the nonce `write_proof` wrote into its proof slot (`peer.proof`),
    so it reads the memory its Hello names: mark it proven. Else `RequestError`."""
    if peer.proven or proof.nonce != peer.proof:
        raise RequestError(f"decoder {peer.peer_id}: wrong ownership proof (it cannot read "
                           "the memory its Hello names)")
    peer.proven = True
