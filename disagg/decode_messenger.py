"""The decoder's KV messenger: pages reserved, request sent, counter armed, then decode (S2a,
S2c, S4c).

A request arrives at the decoder. The messenger pins pages for its whole prompt, arms an
immediate counter expecting pages x layers + 1 context writes, and asks a prefiller to fill
them. Until the counter fires the request stays out of the decode schedule. When it fires, the
messenger unpins the pages, frees the transfer context and hands the request to the engine
with every prompt token but the last already computed; the engine's next step runs the last
prompt token as an ordinary decode step (S8). No message says "done": the writes' immediates do.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from disagg.channel import Channel
from disagg.engine import LLMEngine
from disagg.errors import PeerClosedError
from disagg.handoff import allocate_context_buffer, context_slot_nbytes, unpack_context
from disagg.messages import Hello, HelloAck, KVRequest
from disagg.request import Request, RequestStatus
from disagg.tp import Sharding
from disagg.transfer_plan import PageGeometry, expected_write_count, num_pages, writes_per_page
from transfer_core.engine import TransferEngine

logger = logging.getLogger(__name__)


@dataclass
class PendingKV:
    """A request waiting for its KV: the decoder-side transfer context."""

    request: Request
    imm: int
    context_slot: int
    expected_writes: int
    prefiller: int  # index into the messenger's prefiller list
    started_at: float = 0.0  # time.monotonic() when the prefiller was asked


@dataclass(frozen=True, slots=True)
class KVReceipt:
    """What one request's KV transfer took, as the decoder saw it."""

    writes: int
    nbytes: int
    wait_ms: float  # from asking the prefiller to the counter firing (prefill included)


class DecodeMessenger:
    """Gets KV for new requests from prefillers and releases them to the engine."""

    def __init__(self, engine: LLMEngine, transfer: TransferEngine, node_id: str,
                 model_fingerprint: str, num_context_slots: int = 16) -> None:
        self.engine = engine
        self.transfer = transfer
        self.node_id = node_id
        self.model_fingerprint = model_fingerprint
        config = engine.model.config
        # One region per TP rank: prefillers write each rank's heads straight into it (S5a).
        registered = [transfer.register_memory(shard.buffer, name=f"decode-kv{rank}")
                      for rank, shard in enumerate(engine.kv_cache.shards)]
        self._kv_regions = [region for region, _ in registered]
        self._kv_descriptors = [descriptor for _, descriptor in registered]
        self.context = allocate_context_buffer(config, num_context_slots)
        self._context_region, self._context_descriptor = transfer.register_memory(
            self.context, name="decode-ctx")
        self._free_slots = list(range(num_context_slots))
        self._imms = itertools.count(1)
        self.prefillers: list[Channel] = []
        self._page_writes: list[int] = []  # writes per page per layer, per prefiller
        self._load: list[int] = []  # requests in flight per prefiller
        self.waiting: deque[Request] = deque()  # no pages (or no context slot) yet
        self.pending: dict[str, PendingKV] = {}
        self._ready: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def hello(self) -> Hello:
        """This decoder's handshake: model, cache geometry, fabric address, descriptors."""
        config, cache = self.engine.model.config, self.engine.kv_cache
        return Hello(
            node_id=self.node_id, model=self.model_fingerprint,
            dtype=str(cache.dtype).removeprefix("torch."), page_size=cache.page_size,
            kv_layout=cache.kv_layout, num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            engine_address=self.transfer.address,
            kv_descriptors=[d.to_bytes() for d in self._kv_descriptors],
            context_descriptor=self._context_descriptor.to_bytes(),
            context_slot_nbytes=context_slot_nbytes(config), tp=cache.sharding.tp,
            replicated_kv=cache.sharding.replicated)

    def add_prefiller(self, channel: Channel, ack: HelloAck) -> int:
        """Use a prefiller whose handshake succeeded; returns its index."""
        cache = self.engine.kv_cache
        theirs = Sharding(ack.tp, cache.num_kv_heads, ack.replicated_kv)
        geometry = PageGeometry(cache.kv_layout, cache.page_size, cache.head_dim,
                                cache.shards[0].element_size)
        # The prefiller plans with the same function: both sides agree on the count (S6b).
        self._page_writes.append(writes_per_page(theirs, cache.sharding, geometry))
        self.prefillers.append(channel)
        self._load.append(0)
        return len(self.prefillers) - 1

    def submit(self, request: Request) -> None:
        """A new request (S2a): start its transfer now, or queue it until pages free up.

        Raises `RequestError` at once for a request that could never fit this node's cache.
        """
        self.engine.scheduler.check_fits(request)
        if not self.prefillers:
            self.engine.scheduler.add_request(request)  # single node: prefill it here (S1)
            return
        request.status = RequestStatus.WAITING_FOR_KV
        self.waiting.append(request)
        self._start_waiting()

    def _start_waiting(self) -> None:
        allocator, page_size = self.engine.allocator, self.engine.kv_cache.page_size
        while self.waiting:
            request = self.waiting[0]
            if request.num_prompt_tokens == 1:
                # Nothing to prefill: the one token is an ordinary prefill step here.
                self.waiting.popleft()
                self.engine.scheduler.add_request(request)
                continue
            needed = num_pages(request.num_prompt_tokens, page_size)
            if not allocator.can_allocate(needed) or not self._free_slots:
                return
            self.waiting.popleft()
            request.page_ids = allocator.allocate(needed, pinned=True)
            self._request_kv(request)

    def _request_kv(self, request: Request) -> None:
        config, page_size = self.engine.model.config, self.engine.kv_cache.page_size
        imm = next(self._imms) % 2**32
        slot = self._free_slots.pop()
        index = min(range(len(self.prefillers)), key=self._load.__getitem__)
        expected = expected_write_count(request.num_prompt_tokens, page_size, config.num_layers,
                                        self._page_writes[index])
        self.pending[request.request_id] = PendingKV(request, imm, slot, expected, index,
                                                     time.monotonic())
        self._load[index] += 1
        # Arm the counter before asking: writes may land before this line would otherwise run.
        self.transfer.expect_imm_count(imm, expected, lambda: self._ready.put(request.request_id))
        message = KVRequest(request.request_id, imm, request.prompt_token_ids,
                            request.page_ids, slot)
        try:
            self.prefillers[index].send(message)
        except PeerClosedError as error:
            self.fail(request.request_id, f"prefiller unreachable: {error}")

    def poll(self) -> list[tuple[Request, KVReceipt]]:
        """Hand every request whose counter fired to the engine (S2c); returns them with what
        their KV took."""
        released = []
        while True:
            try:
                request_id = self._ready.get_nowait()
            except queue.Empty:
                break
            pending = self.pending.pop(request_id, None)
            if pending is None:
                continue  # failed or cancelled meanwhile
            self._load[pending.prefiller] -= 1
            self._free_slots.append(pending.context_slot)
            self._release(pending.request)
            released.append((pending.request, self._receipt(pending)))
        self._start_waiting()
        return released

    def _receipt(self, pending: PendingKV) -> KVReceipt:
        cache, model = self.engine.kv_cache, self.engine.model.config
        pages = num_pages(pending.request.num_prompt_tokens - 1, cache.page_size)
        kv_nbytes = sum(shard.page_nbytes for shard in cache.shards)
        nbytes = pages * model.num_layers * kv_nbytes + context_slot_nbytes(model)
        wait_ms = (time.monotonic() - pending.started_at) * 1e3
        return KVReceipt(pending.expected_writes, nbytes, wait_ms)

    def _release(self, request: Request) -> None:
        self.engine.allocator.unpin(request.page_ids)
        request.num_computed_tokens = request.num_prompt_tokens - 1
        self.engine.scheduler.add_prefilled(request)

    def fail(self, request_id: str, reason: str) -> Request | None:
        """The prefiller could not serve `request_id` (it has no write in flight for it)."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return None
        self.transfer.remove_imm_count(pending.imm)
        self._load[pending.prefiller] -= 1
        self._free_slots.append(pending.context_slot)
        request = pending.request
        self.engine.allocator.unpin(request.page_ids)
        self.engine.allocator.free(request.page_ids)
        request.page_ids = []
        request.status = RequestStatus.FINISHED_FAILED
        logger.warning("request %s failed: %s", request_id, reason)
        self._start_waiting()
        return request

    def context_of(self, request_id: str) -> tuple | None:
        """The shipped (hidden state, logits) of a pending request, for tests and S4a users."""
        pending = self.pending.get(request_id)
        if pending is None:
            return None
        return unpack_context(self.context[pending.context_slot], self.engine.model.config)

    def received_writes(self, request_id: str) -> tuple[int, int]:
        """(writes landed, writes expected) of a pending request, for progress displays."""
        pending = self.pending.get(request_id)
        if pending is None:
            return 0, 0
        return self.transfer.imm_counted(pending.imm), pending.expected_writes

    def close(self) -> None:
        """Unregister memory (after the transfer engine drained)."""
        for region in self._kv_regions:
            self.transfer.unregister_memory(region)
        self.transfer.unregister_memory(self._context_region)
