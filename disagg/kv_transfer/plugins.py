"""What a messenger calls on its optional plug-ins; the MTP draft KV is the one there is (S4a,
S8).

A plug-in adds pages to a request's transfer: the prefiller side computes and writes them after
the last chunk, before the context slot; the decoder side counts them and checks them. The
messengers know only these protocols, never the draft model: a node that does not speculate
carries no plug-in, and a prefiller builds its `DraftSource` only once a decoder asks for one in
its handshake (`Hello.draft_kv_descriptor`). `draft_kv.py` implements both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.request import Request
from disagg.kv_transfer.messages import Hello
from disagg.kv_transfer.outgoing_kv import OutgoingKV

# (error or None, writes that completed) -> None: the prefill messenger's write accounting.
WriteDone = Callable[..., None]


class DraftSource(Protocol):
    """Prefiller side: extra pages per request, computed after each forward."""

    def add_peer(self, hello: Hello, peer_pages: int) -> None:
        """Remember a decoder that wants the extra pages (its handshake says where)."""

    def after_forward(self, batch: Batch, output: ForwardOutput,
                      in_flight: Mapping[str, OutgoingKV]) -> None:
        """Compute this forward's extra pages for the requests in flight that want them."""

    def wants(self, outgoing: OutgoingKV) -> bool:
        """Whether `outgoing` ships extra pages."""

    def checksum(self, outgoing: OutgoingKV) -> float:
        """What the extra pages add to the context slot's KV checksum."""

    def post(self, outgoing: OutgoingKV, done: WriteDone) -> None:
        """Write the extra pages; `done(error, writes)` once."""

    def close(self) -> None:
        """Unregister memory (after the transfer engine drained)."""


class DraftSink(Protocol):
    """Decoder side: where the extra pages land, and what they add to a request's count."""

    descriptor: bytes  # the memory prefillers write the pages into (sent in the Hello)

    def expected_writes(self, num_prompt_tokens: int) -> int:
        """Writes of extra pages a request's prefiller sends."""

    def stage_in(self, request: Request) -> None:
        """Copy the request's received pages in from a host shadow (staged path only)."""

    def checksum(self, request: Request) -> float:
        """The received pages' part of the KV checksum."""

    def keep_context(self, request: Request, slot: torch.Tensor) -> None:
        """Keep what the draft needs of the context slot before the slot is reused."""

    def close(self) -> None:
        """Unregister memory (after the transfer engine drained)."""


# Builds the prefiller's source on first demand: nothing is built for decoders that never ask.
DraftSourceFactory = Callable[[], DraftSource]
