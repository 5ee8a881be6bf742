"""A hostile client against a real prefiller and decoder over the tcp provider (S5).

The nodes run in a `spawn`ed process (threads there, as in test_disagg_nodes.py), so this test
process, the attacker, shares no memory with them. It holds what travels in the clear, the
decoder's Hello (its engine address and descriptors), and the project's own binding, and it:
writes with guessed memory keys (sequential from 1, as they once were), floods zero-byte
immediates for guessed values (1, 2, 3, ... as requests once got) through the warm-up region the
engine address publishes, and forges a Hello with the decoder's descriptors. Afterwards not a
byte of the decoder's KV or context slots has changed, the flood is bounded and counted,
requests decode the single-node tokens, and both nodes end clean.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg.control.channel import Channel
from disagg.control.messages import Reject, Submit
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import RequestState, SamplingParams
from disagg.kv_transfer.context_slot import new_nonce
from disagg.kv_transfer.messages import Hello, HelloAck, HelloProof, KVRequest
from disagg.model.loading.registry import load_model
from disagg.node.builder import build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router
from transfer_core.engine import TransferEngine
from transfer_core.imm_counter import MAX_UNARMED_IMMS
from transfer_core.memory import EngineAddress, MemoryRegionDescriptor
from tests.disagg.node.test_disagg_nodes import next_reply

pytestmark = [pytest.mark.fabric, pytest.mark.slow]  # two nodes start in a child: ~5 s

CACHE = CacheConfig(page_size=4, num_pages=128)
PROMPTS = [list(range(3, 3 + n)) for n in (6, 11, 17)]
MAX_TOKENS = 4
FLOOD = MAX_UNARMED_IMMS + 500
TIMEOUT_S = 60.0


def _digest(decode: DecodeNode) -> str:
    """Of every byte a prefiller may write at the decoder, but its proof slot."""
    blake = hashlib.blake2b(digest_size=16)
    for shard in decode.engine.kv_cache.shards:
        blake.update(shard.buffer.contiguous().numpy().tobytes())
    blake.update(decode.messenger.context[:-1].numpy().tobytes())
    return blake.hexdigest()


def _serve_nodes(conn: Any) -> None:
    """Child: a prefiller and a decoder in threads; answers the parent's commands."""
    prefill = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(
        chunk_size=5, max_num_batched_tokens=5, mode="prefill_only"), role=NodeRole.PREFILL))
    assert isinstance(prefill, PrefillNode)
    decode = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(), role=NodeRole.DECODE,
                                   prefillers=(prefill.address,)))
    assert isinstance(decode, DecodeNode)
    threads = [threading.Thread(target=node.run, daemon=True) for node in (prefill, decode)]
    for thread in threads:
        thread.start()
    conn.send((prefill.address, decode.address, decode.messenger.hello()))
    try:
        while (command := conn.recv()) != "stop":
            answers = {"digest": lambda: _digest(decode),
                       "dropped": lambda: decode.transfer.dropped_imms}
            conn.send(answers[command]())
    finally:
        for node in (decode, prefill):
            node.stop()
        for thread in threads:
            thread.join(timeout=10)
        try:
            decode.check_clean()
            prefill.check_clean()
            conn.send("clean")
        except AssertionError as error:
            conn.send(f"not clean: {error}")
        decode.close()
        prefill.close()


class Nodes:
    """The child process: the nodes' addresses, the decoder's Hello, a command channel."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_nodes, args=(child,), daemon=True)
        self.process.start()
        self.prefill_address, self.decode_address, self.hello = self._recv()
        assert isinstance(self.hello, Hello)

    def _recv(self) -> Any:
        if not self._conn.poll(TIMEOUT_S):
            raise TimeoutError("the nodes' process did not answer")
        return self._conn.recv()

    def call(self, command: str) -> Any:
        self._conn.send(command)
        return self._recv()


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    child = Nodes()
    yield child
    if child.process.is_alive():
        assert child.call("stop") == "clean"
    child.process.join(TIMEOUT_S)
    assert child.process.exitcode == 0


def _post_all(engine: TransferEngine, posts: list[Any]) -> None:
    """Run each `post(on_done, on_error)` and wait until every one finished, either way."""
    left, lock, finished = [len(posts)], threading.Lock(), threading.Event()

    def one(*_error: object) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                finished.set()

    for post in posts:
        post(one, one)
    assert finished.wait(TIMEOUT_S), f"{left[0]} posts never finished"


def _attack_the_fabric(hello: Hello) -> None:
    """Guessed keys into offset 0 of the decoder's endpoint, then a flood of zero-byte
    immediates through its published warm-up region (the one key anyone can read)."""
    address = EngineAddress.from_bytes(hello.engine_address)
    endpoint, (probe_key, probe_addr) = address.domains[0], address.probes[0]
    with TransferEngine("tcp") as attacker:
        source, _ = attacker.register_memory(np.full(4096, 255, np.uint8), remote_write=False)
        for key in range(1, 6):
            guess = MemoryRegionDescriptor(f"guess-{key}", attacker.provider, 0, 4096, False,
                                           True, ((endpoint, key),))
            _post_all(attacker, [lambda ok, err, g=guess: attacker.post_write(
                source, 0, 4096, None, g, 0, ok, err)])
            # A wrong key makes tcp drop the connection, and a write posted while it goes is
            # lost: give the next guess a connection of its own.
            threading.Event().wait(0.2)
        probe = MemoryRegionDescriptor("probe", attacker.provider, probe_addr, 64, True, True,
                                       ((endpoint, probe_key),))
        _post_all(attacker, [lambda ok, err, imm=imm: attacker.post_imm(imm, probe, ok, err)
                             for imm in range(1, FLOOD + 1)])


def _forge_hellos(nodes: Nodes) -> list[str]:
    """Two connections with the decoder's Hello: one skips the proof and asks for a request
    writing the decoder's pages, one guesses the proof. Returns the prefiller's refusals."""
    reasons = []
    forged = dataclasses.replace(nodes.hello, node_id="attacker")
    evil = KVRequest("evil", 1, 2, list(range(3, 12)), [0, 1], 0, nonce=new_nonce())
    for follow_up in (evil, HelloProof(new_nonce())):
        channel = Channel.connect(nodes.prefill_address)
        channel.send(forged)
        assert isinstance(channel.recv(), HelloAck)  # its proof went to the real decoder
        channel.send(follow_up)
        reply = next_reply(channel)
        channel.close()
        assert isinstance(reply, Reject), reply
        reasons.append(reply.reason)
    return reasons


def _reference() -> list[list[int]]:
    loaded = load_model("tiny")
    engine = build_engine(EngineConfig(loaded.config, CACHE), loaded.state_dict)
    return [r.output_token_ids for r in engine.generate(PROMPTS, SamplingParams(MAX_TOKENS))]


def _serve(address: str) -> list[list[int]]:
    router = Router([address])
    try:
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        for i, prompt in enumerate(PROMPTS):
            router.route(Submit(f"r{i}", prompt, MAX_TOKENS))
        finished = 0
        while finished < len(PROMPTS):
            event = router.events.get(timeout=TIMEOUT_S)
            assert event.state is not RequestState.FINISHED_FAILED, event.detail
            tokens[event.request_id] += event.token_ids
            finished += event.state.is_terminal()
        return [tokens[f"r{i}"] for i in range(len(PROMPTS))]
    finally:
        router.close()


def test_a_hostile_client_changes_nothing_at_the_decoder(nodes: Nodes) -> None:
    """Guessed keys, a flood of guessed immediates and forged Hellos: the decoder's memory is
    untouched, the flood beyond the bound is dropped and counted, the prefiller refuses both
    forged connections by reason, and requests decode the single-node tokens."""
    before = nodes.call("digest")
    _attack_the_fabric(nodes.hello)
    for _ in range(500):  # the flood's last immediates are counted by the decoder's thread
        if nodes.call("dropped") >= FLOOD - MAX_UNARMED_IMMS:
            break
        threading.Event().wait(0.02)
    assert nodes.call("dropped") == FLOOD - MAX_UNARMED_IMMS
    reasons = _forge_hellos(nodes)
    assert "expected HelloProof" in reasons[0] and "wrong ownership proof" in reasons[1]
    assert nodes.call("digest") == before
    assert _serve(nodes.decode_address) == _reference()
