"""A forward's writes to one decoder, one paged write per rank pair and layer (S3b, S4c, S6).

Every request a forward prefills has its own layer writes (`layer_writes`) and its own immediate
values, which the decoder counts: one for every layer but the last, one for the last (the tail,
S4c). The requests bound for the same decoder, rank pair, write size and domains go out
together: ONE paged write per layer whose pages are all their writes, each page carrying its own
request's immediate (`PagedWrite.imms`, or `tail_imms` in the last layer). The decoder counts
exactly what it counted before, request by request; the layer poller makes one call per peer and
rank pair instead of one per request (S3b). Merged once per forward; a layer drops the requests
that stopped since (their writes are not posted, as before). The members of a call share its
fate: a failed call (a stripe past its deadline, a peer gone, a fault plan's `fail_write`, which
is now drawn per call) fails every request in it. Requests drawn onto different domains (S9a) do
not merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disagg.kv_transfer.decoder_peer import DecoderPeer
from disagg.kv_transfer.layer_writes import LayerWrite
from disagg.kv_transfer.outgoing_kv import ChunkPages, OutgoingKV


@dataclass(frozen=True, slots=True, eq=False)  # arrays inside: compared by identity
class Member:
    """One request's share of a `PeerWrite`: its writes, counted under its immediate."""

    outgoing: OutgoingKV
    write: LayerWrite


@dataclass(frozen=True, slots=True, eq=False)  # arrays inside: compared by identity
class PeerWrite:
    """The writes of `members` (same peer, ranks, size and domains), concatenated in order;
    page i carries `imms[i]`, its request's immediate, or `tail_imms[i]` in the last layer."""

    peer: DecoderPeer
    members: tuple[Member, ...]
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    imms: np.ndarray
    tail_imms: np.ndarray

    @classmethod
    def of(cls, peer: DecoderPeer, members: Sequence[Member]) -> PeerWrite:
        writes = [m.write for m in members]
        counts = [w.num_writes for w in writes]

        def per_page(values: list[int]) -> np.ndarray:
            return np.repeat(np.array(values, dtype=np.uint32), counts)

        return cls(peer, tuple(members), np.concatenate([w.src_offsets for w in writes]),
                   np.concatenate([w.dst_offsets for w in writes]),
                   per_page([m.outgoing.imm for m in members]),
                   per_page([m.outgoing.tail_imm for m in members]))

    def imms_of(self, layer: int, num_layers: int) -> np.ndarray:
        """What its pages carry in `layer`: the tail's values in the last one."""
        return self.tail_imms if layer == num_layers - 1 else self.imms

    @property
    def shape(self) -> LayerWrite:
        """The ranks, size and domains every member shares (its first member's write)."""
        return self.members[0].write

    @property
    def num_writes(self) -> int:
        return len(self.src_offsets)

    def only(self, live: Sequence[Member]) -> PeerWrite:
        """This write with just the `live` members (itself when none has dropped out)."""
        return self if len(live) == len(self.members) else PeerWrite.of(self.peer, live)


def forward_writes(chunks: Sequence[ChunkPages]) -> list[PeerWrite]:
    """The chunks' layer writes merged per (peer, ranks, size, domains), in first-seen order.

    >>> from types import SimpleNamespace as NS
    >>> peer = NS(peer_id="d0")
    >>> writes = {5: LayerWrite(0, 0, 8, None, np.array([0, 16]), np.array([32, 48])),
    ...           9: LayerWrite(0, 0, 8, None, np.array([64]), np.array([96]))}
    >>> chunks = [NS(outgoing=NS(imm=imm, tail_imm=imm + 1, peer=peer), writes=[w])
    ...           for imm, w in writes.items()]
    >>> (merged,) = forward_writes(chunks)
    >>> merged.imms.tolist(), merged.tail_imms.tolist(), merged.dst_offsets.tolist()
    ([5, 5, 9], [6, 6, 10], [32, 48, 96])
    """
    groups: dict[tuple[int, int, int, int, tuple[int, ...] | None], list[Member]] = {}
    for chunk in chunks:
        peer = chunk.outgoing.peer
        for w in chunk.writes:
            key = (id(peer), w.src_rank, w.dst_rank, w.nbytes, w.domains)
            groups.setdefault(key, []).append(Member(chunk.outgoing, w))
    return [PeerWrite.of(members[0].outgoing.peer, members) for members in groups.values()]
