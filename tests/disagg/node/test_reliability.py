"""Failure handling (X4): faults injected into the real fabric, deterministic by seed.

Nodes run in threads of this process over the tcp provider; a `FaultyTransport` loses,
duplicates, delays or fails operations, or stops answering. Whatever happens, every request
must reach exactly one terminal state in bounded time, every request that finishes must decode
the single-node engine's tokens, and both nodes must end with no page, request or counter left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from disagg.config import CacheConfig, EngineConfig, ReliabilityConfig, SchedulerConfig
from disagg.control.channel import Channel
from disagg.control.messages import Reject, RequestEvent, Submit
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import FailureCause, RequestState, SamplingParams
from disagg.errors import ProtocolError
from disagg.kv_transfer.messages import Hello
from disagg.model.loading.registry import load_model
from disagg.node.builder import build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router

pytestmark = pytest.mark.fabric

CACHE = CacheConfig(page_size=4, num_pages=256)
PROMPTS = [list(range(3, 3 + n)) for n in (6, 11, 17, 25)]
MAX_TOKENS = 4
FAST = ReliabilityConfig(kv_timeout_s=1.5, quarantine_timeout_s=0.5, death_grace_s=0.2,
                         max_attempts=3)


def reference() -> list[list[int]]:
    loaded = load_model("tiny")
    engine = build_engine(EngineConfig(loaded.config, CACHE), loaded.state_dict)
    return [r.output_token_ids for r in engine.generate(PROMPTS, SamplingParams(MAX_TOKENS))]


REFERENCE = reference()


@dataclass
class Cluster:
    prefillers: list[PrefillNode]
    decoder: DecodeNode
    router: Router
    threads: list[threading.Thread] = field(default_factory=list)
    retries: list[tuple[str, FailureCause]] = field(default_factory=list)  # (id, why) each
    silent: list[PrefillNode] = field(default_factory=list)  # its writes vanish by design

    def settled(self) -> bool:
        """Nothing left to finish: the decoder holds no request, and every prefiller still
        running (but a silent one, which never ends its transfers) has ended its own."""
        decoder = self.decoder
        if decoder.engine.scheduler.has_unfinished() or not decoder.messenger.idle():
            return False
        return all(not prefiller.messenger.has_work()
                   for prefiller, thread in zip(self.prefillers, self.threads, strict=False)
                   if thread.is_alive() and prefiller not in self.silent)

    def run_all(self, timeout_s: float = 30.0, abort: set[str] = frozenset()
                ) -> dict[str, tuple[str, list[int]]]:
        """Submit PROMPTS; return request id -> (terminal state, tokens)."""
        for i, prompt in enumerate(PROMPTS):
            self.router.route(Submit(f"r{i}", prompt, MAX_TOKENS))
        for request_id in abort:
            self.router.abort(request_id)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        final: dict[str, tuple[str, list[int]]] = {}
        deadline = time.monotonic() + timeout_s
        while len(final) < len(PROMPTS):
            event = self.router.events.get(timeout=max(0.1, deadline - time.monotonic()))
            assert event.request_id not in final, f"second terminal state: {event}"
            self.note_retry(event)
            tokens[event.request_id] += event.token_ids
            if event.state.is_terminal():
                final[event.request_id] = (event.state, tokens[event.request_id])
        return final

    def note_retry(self, event: RequestEvent) -> None:
        """A request sent back to wait for its KV, with a cause: the decoder retries it."""
        if event.state is RequestState.WAITING_FOR_KV and event.cause is not None:
            self.retries.append((event.request_id, event.cause))


def start_prefiller(faults: str | None = None, transfer_timeout_s: float | None = None,
                    ) -> PrefillNode:
    config = NodeConfig("tiny", CACHE, SchedulerConfig(chunk_size=5, max_num_batched_tokens=5,
                                                       mode="prefill_only"),
                        role=NodeRole.PREFILL, faults=faults)
    node = build_node(config)
    assert isinstance(node, PrefillNode)
    if transfer_timeout_s is not None:
        node.transfer.timeout_s = transfer_timeout_s
    return node


@pytest.fixture
def make_cluster() -> Iterator:
    """Factory for a cluster in threads; stops it and checks both sides for leaks after."""
    made: list[Cluster] = []

    def make(prefill_faults: str | None = None, decode_faults: str | None = None,
             num_prefillers: int = 1, transfer_timeout_s: float | None = None) -> Cluster:
        prefillers = [start_prefiller(prefill_faults if i == 0 else None, transfer_timeout_s)
                      for i in range(num_prefillers)]
        config = NodeConfig("tiny", CACHE, SchedulerConfig(), role=NodeRole.DECODE,
                            prefillers=tuple(p.address for p in prefillers),
                            faults=decode_faults, reliability=FAST)
        decoder = build_node(config)
        assert isinstance(decoder, DecodeNode)
        cluster = Cluster(prefillers, decoder, Router([decoder.address]))
        if prefill_faults is not None and "stop_after" in prefill_faults:
            cluster.silent.append(prefillers[0])
        for node in [*prefillers, decoder]:
            thread = threading.Thread(target=node.run, daemon=True)
            thread.start()
            cluster.threads.append(thread)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.router.close()
        # A request's last writes may complete at its prefiller (which then frees its pages)
        # after the decoder reported it; wait for that, bounded: check_clean says what is left.
        deadline = time.monotonic() + 10
        while not cluster.settled() and time.monotonic() < deadline:
            time.sleep(0.01)
        for node in [cluster.decoder, *cluster.prefillers]:
            node.stop()
        for thread in cluster.threads:
            thread.join(timeout=10)
        cluster.decoder.check_clean()
        for prefiller in cluster.prefillers:
            if prefiller.engine.scheduler.has_unfinished() or prefiller.messenger.has_work():
                continue  # a deliberately killed prefiller keeps what it had
            prefiller.check_clean()
        cluster.decoder.close()
        for prefiller in cluster.prefillers:
            prefiller.close()


def assert_outcomes(final: dict[str, tuple[str, list[int]]]) -> None:
    """One terminal state each; every finished request decoded the reference tokens."""
    for i in range(len(PROMPTS)):
        state, tokens = final[f"r{i}"]
        assert state in (*(RequestState.FINISHED_LENGTH, RequestState.FINISHED_STOPPED), RequestState.FINISHED_FAILED,
                         RequestState.FINISHED_ABORTED)
        if state in (RequestState.FINISHED_LENGTH, RequestState.FINISHED_STOPPED):
            assert tokens == REFERENCE[i], f"r{i} decoded garbage"


@pytest.mark.slow  # about 4 s: deadlines have to expire
def test_lost_immediates_are_caught_by_deadline_and_retried(make_cluster: object) -> None:
    """Dropped immediates leave a counter short; the deadline cancels and retries."""
    cluster = make_cluster(decode_faults="seed=4,drop_imm=0.1")
    final = cluster.run_all()
    assert cluster.decoder.transfer.injected["drop_imm"] > 0
    assert_outcomes(final)
    assert sum(s is RequestState.FINISHED_LENGTH for s, _ in final.values()) >= 2
    assert {cause for _, cause in cluster.retries} == {FailureCause.DEADLINE}  # retried


def test_duplicated_immediates_never_decode_garbage(make_cluster: object) -> None:
    """A counter that fires early is caught by the KV checksum; outputs stay exact."""
    cluster = make_cluster(decode_faults="seed=2,duplicate_imm=0.1")
    final = cluster.run_all()
    assert cluster.decoder.transfer.injected["duplicate_imm"] > 0
    assert_outcomes(final)


@pytest.mark.slow  # real nodes and injected faults: about 2 s
def test_failed_writes_end_each_request_once(make_cluster: object) -> None:
    """Writes failing at the prefiller fail or retry requests, never hang them."""
    cluster = make_cluster(prefill_faults="seed=1,fail_write=0.2")
    final = cluster.run_all()
    assert cluster.prefillers[0].transfer.injected["fail_write"] > 0
    assert_outcomes(final)


def test_delayed_and_reordered_writes_still_decode_exactly(make_cluster: object) -> None:
    """Writes posted late and out of order change nothing: the counter waits for all."""
    cluster = make_cluster(prefill_faults="seed=3,delay=0.5,max_delay_s=0.05")
    final = cluster.run_all()
    assert cluster.prefillers[0].transfer.injected["delay"] > 0
    assert all(state is RequestState.FINISHED_LENGTH for state, _ in final.values())
    assert_outcomes(final)


@pytest.mark.slow  # waits out a peer timeout: about 5 s
def test_a_prefiller_that_stops_answering_fails_requests_in_bounded_time(
        make_cluster: object) -> None:
    """A prefiller whose writes vanish: requests time out, are cancelled and fail cleanly."""
    cluster = make_cluster(prefill_faults="seed=0,stop_after=3", transfer_timeout_s=1.0)
    start = time.monotonic()
    final = cluster.run_all(timeout_s=40)
    assert time.monotonic() - start < 40
    assert any(state is RequestState.FINISHED_FAILED for state, _ in final.values())
    assert_outcomes(final)


def test_dead_prefiller_requests_retry_on_another(make_cluster: object) -> None:
    """Killing the prefiller that holds requests mid-transfer moves them to the other."""
    cluster = make_cluster(prefill_faults="seed=0,stop_after=0", num_prefillers=2,
                           transfer_timeout_s=30.0)
    for i, prompt in enumerate(PROMPTS):
        cluster.router.route(Submit(f"r{i}", prompt, MAX_TOKENS))
    dead = cluster.prefillers[0]
    deadline = time.monotonic() + 10
    while not dead.messenger.num_in_flight:  # it holds requests mid-transfer (its writes vanish)
        assert time.monotonic() < deadline, "no request reached the prefiller"
        time.sleep(0.01)
    dead.stop()
    for channel in dead._channels:  # the process dies: its connections drop at once
        channel.close()
    tokens: dict[str, list[int]] = {}
    finished = 0
    while finished < len(PROMPTS):
        event = cluster.router.events.get(timeout=20)
        cluster.note_retry(event)
        tokens.setdefault(event.request_id, []).extend(event.token_ids)
        finished += event.state.is_terminal()
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == REFERENCE
    assert FailureCause.PREFILLER_DIED in {cause for _, cause in cluster.retries}


def test_client_abort_frees_everything(make_cluster: object) -> None:
    """An abort right after submission ends that request as aborted; the others finish."""
    cluster = make_cluster(prefill_faults="seed=5,delay=1.0,max_delay_s=0.2")
    final = cluster.run_all(abort={"r3"})
    # Every write is delayed: the abort, right behind the Submit, always lands first.
    assert final["r3"] == (RequestState.FINISHED_ABORTED, [])
    assert_outcomes(final)


def test_unauthenticated_peer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cluster secret, a frame without a tag, or with a wrong one, is refused."""
    monkeypatch.setenv("DISAGG_CLUSTER_SECRET", "s3cret")
    prefiller = start_prefiller()
    try:
        # connect() sends an unsigned opening Heartbeat: refused at once, so no Hello follows
        # (the prefiller may have hung up before it could be sent).
        intruder = Channel.connect(prefiller.address, secret=b"")
        with pytest.raises(ProtocolError, match="signed frame"):
            intruder.recv()  # the prefiller's nonce preface: the intruder has no secret
        impostor = Channel.connect(prefiller.address, secret=b"guess")
        impostor.send(Hello("y", "m", "float32", 4, "NHD", 2, 4, 8, b"", [], b"", 1))
        with pytest.raises(ProtocolError, match="bad authentication tag"):
            impostor.recv()
        good = Channel.connect(prefiller.address)
        good.send(Hello("z", "m", "float32", 4, "NHD", 2, 4, 8, b"", [], b"", 1))
        reply = good.recv()
        assert isinstance(reply, Reject) and "model" in reply.reason  # authenticated: judged
    finally:
        prefiller.close()
