"""Disaggregated serving with the KV staged through host shadows on both sides (S5).

On CPU the staged path is forced (`kv_memory_path="staged"`), so writes leave from and land in
host copies of the KV cache, with `stage_out` before each layer's writes and `stage_in` before
the decoder's checksum. Greedy tokens must equal the single-node engine's; and with either copy
skipped the KV checksum must fail, which proves staging is really in the data path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest

from disagg.config import (
    CacheConfig,
    EngineConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg.control.channel import Channel
from disagg.control.messages import Reject, Submit
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import RequestState, SamplingParams
from disagg.kv_transfer.context_slot import context_slot_nbytes
from disagg.model.loading.registry import load_model
from disagg.node.builder import build_node, open_transfer
from disagg.node.cluster_config import ClusterConfig
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router
from tests.disagg.node.test_disagg_e2e import (
    disaggregated_tokens,
    random_prompts,
    single_node_tokens,
)
from transfer_core.errors import ProviderNotFoundError
from transfer_core.pyfabric import find_infos
from transfer_core.staging import RegisteredKV

pytestmark = pytest.mark.fabric

CACHE = CacheConfig(page_size=4, num_pages=128)
MAX_TOKENS = 4
PROMPTS = random_prompts([2, 7, 13, 21], vocab_size=512, seed=3)
FAST = ReliabilityConfig(quarantine_timeout_s=0.3, death_grace_s=0.1, max_attempts=1)


@dataclass
class Pair:
    prefill: PrefillNode
    decode: DecodeNode
    router: Router

    def serve(self, prompt: list[int], request_id: str) -> tuple[str, str, list[int]]:
        """One request: (terminal state, detail, tokens)."""
        self.router.route(Submit(request_id, prompt, MAX_TOKENS))
        tokens: list[int] = []
        while True:
            event = self.router.events.get(timeout=30)
            tokens += event.token_ids
            if event.state.is_terminal():
                return event.state, event.detail, tokens


def node_config(mode: str, speculative: SpeculativeConfig | None = None,
                prefillers: tuple[str, ...] = ()) -> NodeConfig:
    role = (NodeRole.PREFILL if mode == "prefill_only"
            else NodeRole.DECODE if prefillers else NodeRole.MIXED)
    return NodeConfig("tiny", CACHE, SchedulerConfig(chunk_size=5, max_num_batched_tokens=5,
                                                     mode=mode),  # type: ignore[arg-type]
                      role=role, prefillers=prefillers, kv_memory_path="staged",
                      speculative=speculative, reliability=FAST)


@pytest.fixture
def make_staged_pair() -> Iterator[Callable[..., Pair]]:
    """Factory: a staged prefiller and a staged decoder (speculating if asked) in threads;
    after the test both are stopped and must end clean."""
    made: list[tuple[Pair, list[threading.Thread]]] = []

    def make(speculative: SpeculativeConfig | None = None) -> Pair:
        prefill = build_node(node_config("prefill_only"))
        decode = build_node(node_config("mixed", speculative, (prefill.address,)))
        assert isinstance(prefill, PrefillNode) and isinstance(decode, DecodeNode)
        threads = [threading.Thread(target=node.run, daemon=True) for node in (prefill, decode)]
        for thread in threads:
            thread.start()
        made.append((Pair(prefill, decode, Router([decode.address])), threads))
        return made[-1][0]

    yield make
    for pair, threads in made:
        pair.router.close()
        for node in (pair.decode, pair.prefill):
            node.stop()
        for thread in threads:
            thread.join(timeout=10)
        pair.prefill.check_clean()
        pair.decode.check_clean()
        pair.decode.close()
        pair.prefill.close()


@pytest.fixture
def staged_pair(make_staged_pair: Callable[..., Pair]) -> Pair:
    """A staged pair without speculation."""
    return make_staged_pair()


def reference(prompts: list[list[int]]) -> list[list[int]]:
    loaded = load_model("tiny")
    engine = build_engine(EngineConfig(loaded.config, CACHE), loaded.state_dict)
    return [r.output_token_ids for r in engine.generate(prompts, SamplingParams(MAX_TOKENS))]


def test_staged_nodes_decode_the_single_node_tokens(staged_pair: Pair) -> None:
    """Both sides staged: every prompt decodes the single-node tokens, and bytes went through
    the shadows on both sides."""
    results = [staged_pair.serve(p, f"r{i}") for i, p in enumerate(PROMPTS)]
    assert [tokens for _, _, tokens in results] == reference(PROMPTS)
    prefill, decode = staged_pair.prefill.messenger, staged_pair.decode.messenger
    assert all(kv.path.kind == "staged" for kv in decode.kv)
    slot_nbytes = context_slot_nbytes(staged_pair.prefill.engine.model.config)
    # Every KV byte written was staged out; the context slots are host memory anyway.
    assert prefill.stats["staged_bytes"] == prefill.stats["bytes"] - len(PROMPTS) * slot_nbytes
    assert decode.kv[0].staged_bytes >= prefill.stats["staged_bytes"]


def test_staged_mtp_pages_cross_the_split(make_staged_pair: Callable[..., Pair]) -> None:
    """With an MTP head the head's pages are staged too (the checksum covers them): tokens
    still equal the single-node engine's, and both MTP caches moved bytes."""
    pair = make_staged_pair(SpeculativeConfig("mtp", 3))
    results = [pair.serve(p, f"r{i}") for i, p in enumerate(PROMPTS)]
    assert [tokens for _, _, tokens in results] == reference(PROMPTS)
    assert pair.prefill.messenger.draft.kv.staged_bytes > 0
    assert pair.decode.messenger.draft_kv.kv.staged_bytes > 0


def test_decoder_tells_the_prefiller_its_memory_path(staged_pair: Pair) -> None:
    """The Hello carries the decoder's path; the prefiller keeps it on the peer."""
    assert staged_pair.decode.messenger.hello().kv_memory_path == "staged"
    channel = Channel.connect(staged_pair.prefill.address)
    channel.send(replace(staged_pair.decode.messenger.hello(), node_id="rogue",
                         kv_memory_path="gpudirect"))
    reply = channel.recv()
    channel.close()
    assert isinstance(reply, Reject)
    assert "unknown KV memory path 'gpudirect'" in reply.reason


@pytest.mark.parametrize("skipped", ["stage_out", "stage_in"])
def test_skipping_a_staging_copy_fails_the_kv_checksum(
        staged_pair: Pair, monkeypatch: pytest.MonkeyPatch, skipped: str) -> None:
    """Without the prefiller's copy out (zeros leave) or the decoder's copy in (the cache
    keeps zeros), the checksum catches it: staging is really in the data path."""
    noop: Callable[..., None] = lambda *args, **kwargs: None  # noqa: E731
    monkeypatch.setattr(RegisteredKV, skipped, noop)
    state, detail, tokens = staged_pair.serve(PROMPTS[2], "broken")
    assert (state, tokens) == (RequestState.FINISHED_FAILED, [])
    assert "KV checksum mismatch" in detail


def test_cuda_node_without_fi_hmem_opens_for_staging(caplog: pytest.LogCaptureFixture) -> None:
    """A CUDA node on a libfabric without FI_HMEM (Debian's) opens the fabric without it and
    says why; its "auto" KV then stages (the choice itself is tested in transfer_core)."""
    try:
        find_infos("tcp", hmem=True)
        pytest.skip("this libfabric has an FI_HMEM tcp provider")
    except ProviderNotFoundError:
        pass
    config = replace(node_config("mixed"), device="cuda", kv_memory_path="auto")
    with caplog.at_level(logging.INFO, logger="transfer_core.staging"), \
            open_transfer(config) as transfer:
        assert not transfer.supports_hmem
        assert transfer.memory_path == "auto"
    assert "no provider offers FI_HMEM" in caplog.text


@pytest.mark.slow
def test_staged_processes_match_single_node() -> None:
    """Real `disagg serve` processes over tcp, both staged: tokens equal, nodes exit 0."""
    prompts = random_prompts([1, 2, 5, 17, 40, 9], vocab_size=512)
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, chunk_size=7,
                                        kv_memory_path="staged")
    ours, result = disaggregated_tokens(config, prompts, 12)
    assert ours == single_node_tokens("tiny", prompts, 12)
    for node in ("prefill-0", "decode-0"):
        staged = [v for k, v in result["metrics"][node].items() if "staged_bytes" in k]
        assert staged, f"{node}'s metrics have no staged bytes counter"
        assert staged[0] > 0
