"""A prefiller and a decoder messenger in one process, over a `LoopbackFabric` (S2-S4, X4).

`Harness` wires both sides with the nodes' own builder (`build_prefill_side`,
`build_decode_side`: the layer counter into the prefiller's model and its messenger, the
messenger as the prefill engine's observer, a decoder engine with its messenger and, asked for,
its MTP speculator), over `LoopbackEngine`s instead of libfabric and a `socket.socketpair()`
for the control channel. Nothing runs in node threads: `pump()` does one turn of both node
loops, in their order (prefiller: deliver the decoder's messages, step, poll, expire leases;
decoder: deliver the prefiller's messages, poll, step), and `run_until` repeats it.
Messages crossing the channel are logged per direction so tests can look at them.
`prefill_tp` / `decode_tp` split a side's KV by head over that many shards in this process,
the regions a TP leader maps from its ranks (S5a, S6b), without rank processes.
"""

from __future__ import annotations

import select
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from disagg.config import (
    CacheConfig,
    EngineConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg.control.channel import Channel
from disagg.control.framing import Message
from disagg.engine.llm_engine import EngineParts, build_engine
from disagg.engine.model_runner import ModelRunner
from disagg.engine.request import FailureCause, Request, RequestState, SamplingParams
from disagg.errors import RequestError
from disagg.kv_transfer.decoder_peer import DecoderPeer
from disagg.kv_transfer.handshake import clear_proof, read_proof
from disagg.kv_transfer.messages import Cancel, Hello, HelloAck, HelloProof, KVFailed, KVRequest
from disagg.kv_transfer.pending_kv import Outcome
from disagg.model.kv_cache import PagedKVCache
from disagg.model.loading.registry import LoadedModel, load_model
from disagg.model.sharded_kv_cache import ShardedKVCache, shard_config
from disagg.model.sharding import Sharding
from disagg.node.base import Inbox
from disagg.node.builder import decode_parts, prefill_parts, wire_decode_side, wire_prefill_side
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.rank_placement import NodePlacement, plan_placement
from disagg.utils.trace import Tracer
from transfer_core.imm_counter import ImmBatch
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric
from transfer_core.topology import detect_topology

CACHE = CacheConfig(page_size=4, num_pages=64)
PREFILL_CHUNK = 5  # not a multiple of the page size: chunks end mid-page
MAX_TOKENS = 5
_MODEL: list[LoadedModel] = []


def tiny_model() -> LoadedModel:
    """The "tiny" preset (random weights, seed 0), loaded once per process."""
    if not _MODEL:
        _MODEL.append(load_model("tiny"))
    return _MODEL[0]


def random_prompt(length: int, seed: int = 0) -> list[int]:
    """`length` token ids in [3, vocab), avoiding the EOS id 0."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, tiny_model().config.vocab_size, (length,),
                         generator=generator).tolist()


def arrivals_of(transfer: LoopbackEngine) -> Counter[int]:
    """Arrivals of each immediate value on `transfer` from now on, as its counters get them
    (a tap): unlike `imm_counted`, not consumed when a counter fires."""
    arrivals: Counter[int] = Counter()

    def tap(batch: ImmBatch) -> ImmBatch:
        for imm, n in batch:
            arrivals[imm] += n
        return batch

    transfer.tap_imms(tap)
    return arrivals


def single_node_tokens(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """The reference: the same model as one mixed engine, greedy."""
    loaded = tiny_model()
    engine = build_engine(EngineConfig(loaded.config, CACHE), loaded.state_dict)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].output_token_ids


def sharded_stand_in(parts: EngineParts, tp: int) -> EngineParts:
    """`parts` with its KV split by head over `tp` shards in this process: one region per
    rank, as a TP leader holds them (S5a), but no rank processes. The TP 1 model reads and
    writes every head through the `ShardedKVCache` view, so a mismatched pair's writes (S6b)
    move real bytes; allocator and scheduler stay as they were."""
    if tp == 1:
        return parts
    config, model = parts.config, parts.model.config
    sharding = Sharding(tp, model.num_kv_heads)
    shards = [PagedKVCache(shard_config(model, sharding), config.cache, config.device)
              for _ in range(tp)]
    kv_cache = ShardedKVCache(model, config.cache, sharding, shards)
    return replace(parts, kv_cache=kv_cache, runner=ModelRunner(parts.model, kv_cache))


def placement(tp: int, domains_per_rank: int) -> NodePlacement:
    """A node's rank placement on this machine (stand-in domains: no RDMA NIC here), as the
    builder plans it (S5b)."""
    return plan_placement(detect_topology(), tp, "cpu", domains_per_rank)


def receive_ready(channel: Channel, sender: Channel) -> list[Message]:
    """Every message `sender` (the other end) has sent to `channel` so far: its queue goes
    out first (sends are queued, X5c); never blocks on an empty socket."""
    assert sender.flush(5.0), "the other end's frames did not go out"
    messages = []
    while select.select([channel.sock], [], [], 0)[0]:
        messages.append(channel.recv())
    return messages


@dataclass
class Harness:
    """A prefill engine + messenger and a decode engine + messenger over one fabric."""

    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    lease_s: float = 300.0
    # Each layer posts alone (S3 as written) unless a test groups them (X9a)
    min_post_bytes: int = 0
    draft_kv: bool = False  # give the decoder an MTP cache (its Hello then asks for draft KV)
    inline: bool = True  # loopback delivery in the caller's thread (deterministic)
    connect: bool = True  # shake hands at construction
    kv_layout: str = "NHD"
    prefill_prefix_caching: bool = True  # each side's prefix cache (X2)
    decode_prefix_caching: bool = True
    prefill_num_pages: int = CACHE.num_pages
    prefill_budget: int = PREFILL_CHUNK  # tokens per prefill step (chunks stay PREFILL_CHUNK)
    prefill_tp: int = 1  # KV shards on each side (`sharded_stand_in`)
    decode_tp: int = 1
    prefill_domains_per_rank: int = 1  # each rank's fabric domains (S5b, S6a)
    decode_domains_per_rank: int = 1
    to_prefiller: list[Message] = field(default_factory=list)  # every message, in order
    to_decoder: list[Message] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)  # of every decode_messenger.poll()
    prefill_tracer: Tracer = field(default_factory=Tracer)  # records nothing unless given one

    def __post_init__(self) -> None:
        loaded = tiny_model()
        self.fabric = LoopbackFabric()
        prefill_placement = placement(self.prefill_tp, self.prefill_domains_per_rank)
        decode_placement = placement(self.decode_tp, self.decode_domains_per_rank)
        self.prefill_transfer = LoopbackEngine(fabric=self.fabric, deliver_inline=self.inline,
                                               num_domains=prefill_placement.num_domains)
        self.decode_transfer = LoopbackEngine(fabric=self.fabric, deliver_inline=self.inline,
                                              num_domains=decode_placement.num_domains)
        prefill_config = NodeConfig(
            "tiny", role=NodeRole.PREFILL, node_id="prefill-0", lease_s=self.lease_s,
            min_post_bytes=self.min_post_bytes,
            cache=replace(CACHE, kv_layout=self.kv_layout, num_pages=self.prefill_num_pages,
                          prefix_caching=self.prefill_prefix_caching),
            scheduler=SchedulerConfig(chunk_size=PREFILL_CHUNK,
                                      max_num_batched_tokens=self.prefill_budget,
                                      mode="prefill_only"))
        decode_config = NodeConfig(
            "tiny", role=NodeRole.DECODE, node_id="decode-0", reliability=self.reliability,
            prefillers=("127.0.0.1:0",),  # not dialled: the harness carries the messages
            cache=replace(CACHE, kv_layout=self.kv_layout,
                          prefix_caching=self.decode_prefix_caching),
            scheduler=SchedulerConfig(chunk_size=8, max_num_batched_tokens=16),
            speculative=SpeculativeConfig("mtp") if self.draft_kv else None)
        # The nodes' own wiring (`builder.py`), over loopback transports, without their
        # control planes: this harness carries the messages.
        self.inboxes = (Inbox(), Inbox())
        parts, counter = prefill_parts(prefill_config, loaded, self.inboxes[0])
        self.prefill_parts = sharded_stand_in(parts, self.prefill_tp)
        self.prefill_engine, self.prefill = wire_prefill_side(
            prefill_config, self.prefill_parts, counter, self.prefill_transfer, self.inboxes[0],
            self.prefill_tracer, prefill_placement)
        self.decode_parts = sharded_stand_in(decode_parts(decode_config, loaded, self.inboxes[1]),
                                             self.decode_tp)
        self.decode_engine, self.decode = wire_decode_side(
            decode_config, loaded, self.decode_parts, self.decode_transfer, self.inboxes[1],
            decode_placement)
        self.free_pages = (self.prefill_parts.allocator.num_free,
                           self.decode_parts.allocator.num_free)
        a, b = socket.socketpair()
        self.decode_channel = Channel(a, "prefill-0", secret=b"")  # b"": no HMAC, whatever env
        self.prefill_channel = Channel(b, "decode-0", secret=b"")
        self.extra_channels: list[Channel] = []
        self.peer: DecoderPeer | None = None
        if self.connect:
            self.handshake()

    def _model(self, config: EngineConfig, counter: LayerCounter | None = None
               ) -> Transformer | TPLeader:
        """The whole model; at TP > 1 run over every rank's shard of an in-process
        `ShardedKVCache` (no rank processes: the messengers see the shards a leader maps)."""
        model = load_transformer(config, tiny_model().state_dict, counter)
        if self.tp == 1:
            return model
        sharding = Sharding(self.tp, config.model.num_kv_heads)
        shards = [PagedKVCache(shard_config(config.model, sharding), config.cache)
                  for _ in range(self.tp)]
        cache = ShardedKVCache(config.model, config.cache, sharding, shards)
        return TPLeader(model, cache, cache, None)  # type: ignore[arg-type]

    def _rank_domains(self, per_rank: int) -> list[tuple[int, ...]] | None:
        """Rank r's domains, numbered rank by rank as `plan_placement` does (None at TP 1)."""
        if self.tp == 1 and per_rank == 1:
            return None
        return [tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(self.tp)]

    def handshake(self) -> None:
        """As the nodes shake hands: Hello over the channel, `add_peer` (which writes the proof
        slot), HelloAck back, the decoder's `HelloProof` from its own memory, `accept_proof`,
        `add_prefiller`."""
        clear_proof(self.decode.context)
        self.decode_channel.send(self.decode.hello())
        hello = self.prefill_channel.recv()
        assert isinstance(hello, Hello)
        peer = self.prefill.add_peer(hello, self.prefill_channel)
        sharding = self.prefill_parts.kv_cache.sharding
        self.prefill_channel.send(HelloAck("prefill-0", self.prefill_transfer.address,
                                           sharding.tp, sharding.replicated))
        ack = self.decode_channel.recv()
        assert isinstance(ack, HelloAck)
        self.decode_channel.send(read_proof(self.decode.context, self.decode_transfer.num_domains))
        proof = self.prefill_channel.recv()
        assert isinstance(proof, HelloProof)
        self.prefill.accept_proof(peer, hello, proof)
        self.peer = peer
        self.decode.add_prefiller(self.decode_channel, ack)

    def extra_peer(self, hello: Hello) -> tuple[DecoderPeer, Channel]:
        """Another decoder connection to the prefiller, proved with this decoder's memory (its
        Hello names this decoder's regions); returns its peer and decoder-side end."""
        a, b = socket.socketpair()
        ours, theirs = Channel(a, "prefill-0", secret=b""), Channel(b, hello.node_id, secret=b"")
        self.extra_channels += [ours, theirs]
        clear_proof(self.decode.context)  # as a decoder does before each Hello
        peer = self.prefill.add_peer(hello, theirs)
        proof = read_proof(self.decode.context, self.decode_transfer.num_domains)
        self.prefill.accept_proof(peer, hello, proof)
        return peer, ours

    def submit(self, prompt: list[int], request_id: str = "r0",
               max_tokens: int = MAX_TOKENS, traceparent: str = "") -> Request:
        """A new request at the decoder, as `DecodeNode._submit` makes it (`traceparent`: the
        context of its span there)."""
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens),
                          tiny_model().config.eos_token_ids, traceparent=traceparent)
        self.decode.admit(request)
        return request

    # One turn of each node loop.

    def deliver_to_prefiller(self) -> None:
        """The prefill node's dispatch of a decoder's messages."""
        assert self.peer is not None
        for message in receive_ready(self.prefill_channel, self.decode_channel):
            self.to_prefiller.append(message)
            if isinstance(message, KVRequest):
                try:
                    self.prefill.start_request(message, self.peer)
                except RequestError as error:
                    self.prefill_channel.send(KVFailed(
                        message.request_id, FailureCause.PREFILLER_REFUSED, str(error)))
            elif isinstance(message, Cancel):
                self.prefill.cancel(self.peer, message.request_id)

    def step_prefiller(self) -> None:
        """Step the prefill engine if it has work, then free and report what ended."""
        if self.prefill_engine.has_unfinished():
            self.prefill_engine.step()
        self.prefill.poll()
        self.prefill.expire_leases()

    def deliver_to_decoder(self) -> None:
        """The decode node's dispatch of a prefiller's messages."""
        for message in receive_ready(self.decode_channel, self.prefill_channel):
            self.to_decoder.append(message)
            if isinstance(message, KVFailed):
                self.decode.on_kv_failed(message)

    def step_decoder(self) -> None:
        """Poll the decode messenger (release, deadlines, quarantine), then step the engine."""
        self.outcomes += self.decode.poll()
        if self.decode_engine.has_unfinished():
            self.decode_engine.step()

    def pump(self) -> None:
        """One turn of the prefill node's loop, then one of the decode node's."""
        for inbox in self.inboxes:  # only bells ring here (a rank's failure would raise)
            inbox.drain(lambda item: None, block=False)
        self.deliver_to_prefiller()
        self.step_prefiller()
        self.deliver_to_decoder()
        self.step_decoder()

    def run_until(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """Pump until `predicate()` holds; fails the test after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached in {timeout_s:g} s; outcomes "
                                     f"{[(o.state, o.cause) for o in self.outcomes]}")
            busy = self.prefill_engine.has_unfinished() or self.decode_engine.has_unfinished()
            self.pump()
            if not busy:
                time.sleep(0.001)  # waiting on a deadline or another thread: let it run

    def run_to_end(self, request: Request, timeout_s: float = 5.0) -> None:
        """Pump until `request` is terminal and both sides are idle."""
        self.run_until(lambda: request.is_finished and self.idle(), timeout_s)

    def idle(self) -> bool:
        """Nothing in flight on either side, nothing scheduled."""
        return (not self.prefill.has_work() and self.decode.idle()
                and not self.prefill_engine.has_unfinished()
                and not self.decode_engine.has_unfinished())

    def outcomes_of(self, request_id: str) -> list[tuple[RequestState, FailureCause | None]]:
        """(state, cause) of every outcome reported for `request_id`, in order."""
        return [(o.state, o.cause) for o in self.outcomes if o.request.request_id == request_id]

    def check_clean(self) -> None:
        """No page, transfer, pending request or armed counter left on either side."""
        assert self.fabric.quiesce(5.0)
        assert self.prefill_transfer.held_writes() == 0
        assert self.prefill.num_in_flight == 0
        assert self.decode.idle()
        assert not self.decode_transfer.pending_imm_counts()
        assert (self.prefill_parts.allocator.num_free,
                self.decode_parts.allocator.num_free) == self.free_pages
        self.prefill_parts.allocator.check_invariants(expect_all_free=True)
        self.decode_parts.allocator.check_invariants(expect_all_free=True)
        assert not self.prefill_tracer.num_open, "request spans still open"

    def close(self) -> None:
        """Land held writes, then close channels, messengers and engines (as a node does)."""
        self.prefill_transfer.release()
        self.fabric.quiesce(5.0)
        for channel in [self.decode_channel, self.prefill_channel, *self.extra_channels]:
            channel.close()
        self.prefill.close()
        self.decode.close()
        self.prefill_transfer.close()
        self.decode_transfer.close()
