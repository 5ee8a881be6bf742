"""Speculative decoding across the prefill/decode split (S8, S4a, S4c).

A prefiller and a speculating decoder run in threads over the real tcp provider; the slow tests
run `disagg serve` processes through `run_demo`. Greedy tokens must be the single-node
engine's. With the MTP head the prefiller also ships the head's pages: the decoder's expected
count includes them, a missing context write is caught by the KV deadline, and a duplicated
one (firing the counter before the head's pages landed) by the KV checksum, then retried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from disagg.apps.demo import PromptSpec, run_demo
from disagg.config import (
    CacheConfig,
    EngineConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg.control.messages import RequestEvent, Submit
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import RequestState, SamplingParams
from disagg.kv_transfer.draft_kv import draft_kv_pages
from disagg.kv_transfer.transfer_plan import expected_write_count
from disagg.model.loading.registry import load_model
from disagg.node.builder import build_node
from disagg.node.cluster_config import ClusterConfig
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router

pytestmark = pytest.mark.fabric

CACHE = CacheConfig(page_size=4, num_pages=256)
MAX_TOKENS = 10
FAST = ReliabilityConfig(kv_timeout_s=1.0, quarantine_timeout_s=1.0, max_attempts=2)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def single_node(prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The reference: the tiny model on one node, greedy, no speculation."""
    loaded = load_model("tiny")
    engine = build_engine(EngineConfig(loaded.config, CACHE, SchedulerConfig()),
                          loaded.state_dict)
    return [r.output_token_ids for r in engine.generate(prompts, SamplingParams(max_tokens))]


class Pair:
    """A prefiller and a speculating decoder in threads, and a router to the decoder."""

    def __init__(self, kind: str, reliability: ReliabilityConfig | None = None) -> None:
        scheduler = SchedulerConfig(chunk_size=5, max_num_batched_tokens=5, mode="prefill_only")
        prefill = build_node(NodeConfig("tiny", CACHE, scheduler, role=NodeRole.PREFILL))
        assert isinstance(prefill, PrefillNode)
        self.prefill = prefill
        spec = SpeculativeConfig(kind, 3, draft_layers=1)  # type: ignore[arg-type]
        config = NodeConfig("tiny", CACHE, SchedulerConfig(chunk_size=5,
                                                            max_num_batched_tokens=16),
                            role=NodeRole.DECODE, prefillers=(prefill.address,),
                            speculative=spec, reliability=reliability or ReliabilityConfig())
        decode = build_node(config)
        assert isinstance(decode, DecodeNode)
        self.decode = decode
        self.threads = [threading.Thread(target=node.run, daemon=True)
                        for node in (self.prefill, self.decode)]
        for thread in self.threads:
            thread.start()
        self.router = Router([self.decode.address])

    def serve(self, prompts: list[list[int]]) -> dict[str, list[RequestEvent]]:
        """Submit every prompt; return each request's events up to its terminal one."""
        for i, prompt in enumerate(prompts):
            self.router.route(Submit(f"r{i}", prompt, MAX_TOKENS))
        events: dict[str, list[RequestEvent]] = {f"r{i}": [] for i in range(len(prompts))}
        done: set[str] = set()
        while len(done) < len(prompts):
            event = self.router.events.get(timeout=30)
            events[event.request_id].append(event)
            if event.state.is_terminal():
                done.add(event.request_id)
        return events

    def close(self) -> None:
        self.router.close()
        for node in (self.decode, self.prefill):
            node.stop()
        for thread in self.threads:
            thread.join(timeout=10)
        self.prefill.check_clean()
        self.decode.check_clean()
        self.decode.close()
        self.prefill.close()


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    """Factory of `Pair`s; each is shut down (and checked clean) after the test."""
    pairs: list[Pair] = []

    def make(kind: str, reliability: ReliabilityConfig | None = None) -> Pair:
        pairs.append(Pair(kind, reliability))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


def tokens(events: dict[str, list[RequestEvent]]) -> list[list[int]]:
    return [[t for e in events[f"r{i}"] for t in e.token_ids] for i in range(len(events))]


@pytest.mark.parametrize("kind", ["mtp", "early-exit"])
def test_greedy_tokens_equal_single_node(make_pair: Callable[..., Pair], kind: str) -> None:
    """Prompts of 1 to 30 tokens, prefilled remotely in chunks, decoded speculatively: the
    single-node tokens; drafts were verified and the counts reached the router."""
    prompts = random_prompts([1, 2, 3, 9, 17, 30])
    events = make_pair(kind).serve(prompts)
    assert tokens(events) == single_node(prompts)
    assert sum(events[r][-1].num_draft_tokens for r in events) > 0


def test_mtp_pages_are_counted_in_the_expected_writes(make_pair: Callable[..., Pair]) -> None:
    """Each request's writes: pages x layers + the head's pages + the context slot (S4c)."""
    prompts = random_prompts([2, 6, 23])
    events = make_pair("mtp").serve(prompts)
    for i, prompt in enumerate(prompts):
        writes = max(e.kv_writes for e in events[f"r{i}"])
        assert writes == (expected_write_count(len(prompt), CACHE.page_size, 2)
                          + draft_kv_pages(len(prompt), CACHE.page_size))


def patch(transfer: Any, name: str, wrapper: Callable[..., None]) -> None:
    """Route `transfer.<name>` through `wrapper(original, *args, **kwargs)`."""
    original = getattr(transfer, name)
    setattr(transfer, name, lambda *a, **kw: wrapper(original, *a, **kw))


def test_a_missing_context_write_is_caught_by_the_deadline(
        make_pair: Callable[..., Pair]) -> None:
    """The prefiller 'forgets' the context write: the decoder's counter stays one short, the
    KV deadline fires, and the request fails instead of hanging."""
    pair = make_pair("mtp", ReliabilityConfig(kv_timeout_s=0.5, quarantine_timeout_s=0.5,
                                              max_attempts=1))
    patch(pair.prefill.transfer, "post_write",
          lambda original, *args, on_done, on_error, **kw: on_done())  # reported, never sent
    start = time.monotonic()
    events = pair.serve([list(range(3, 9))])["r0"]
    assert events[-1].state is RequestState.FINISHED_FAILED
    assert "did not arrive" in events[-1].detail
    assert time.monotonic() - start < 15


def test_a_duplicated_context_write_is_caught_by_the_checksum(
        make_pair: Callable[..., Pair]) -> None:
    """The context write goes twice while the head's page is held back: the count is reached
    early, the KV checksum (which covers the head's pages) disagrees, and the retry decodes
    the right tokens."""
    pair = make_pair("mtp", FAST)
    region = pair.prefill.messenger.draft.region
    once = {"duplicate": True, "delay": True}

    def twice(original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        if once.pop("duplicate", False):
            original(*args, **{**kwargs, "on_done": lambda: None, "on_error": lambda _: None})

    def late(original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        if args[0].src_mr is region and once.pop("delay", False):  # args[0]: the PagedWrite
            threading.Timer(0.4, original, args, kwargs).start()
            return
        original(*args, **kwargs)

    patch(pair.prefill.transfer, "post_write", twice)
    patch(pair.prefill.transfer, "post_paged_writes", late)
    prompt = list(range(3, 9))  # positions 0..3 of the head: exactly one page of 4
    assert draft_kv_pages(len(prompt), CACHE.page_size) == 1
    events = pair.serve([prompt])["r0"]
    assert any("KV checksum mismatch" in e.detail for e in events)
    assert events[-1].state in (RequestState.FINISHED_LENGTH, RequestState.FINISHED_STOPPED)
    assert [t for e in events for t in e.token_ids] == single_node([prompt])[0]


# Every pair of values of (k, kind, layout) once: 4 cases of 3 processes, not the 8 of the
# full product; the in-process pair above runs both kinds.
@pytest.mark.slow
@pytest.mark.parametrize(("k", "kind", "kv_layout"),
                         [(1, "early-exit", "NHD"), (1, "mtp", "HND"),
                          (4, "early-exit", "HND"), (4, "mtp", "NHD")])
def test_processes_decode_the_single_node_tokens(kv_layout: str, kind: str, k: int) -> None:
    """`disagg serve` processes (1 prefiller, 2 decoders) with `--speculative`: the
    single-node tokens, every node exits clean, and the totals carry the acceptance rate."""
    prompts = random_prompts([1, 2, 5, 17, 40, 9, 26], seed=k)
    config = ClusterConfig.from_options(model="tiny", num_decoders=2, kv_layout=kv_layout,
                                        page_size=4, chunk_size=7, speculative=kind,
                                        num_draft_tokens=k, draft_layers=1)
    result = run_demo(config, [PromptSpec(token_ids=p) for p in prompts], MAX_TOKENS,
                      exit_codes=True)
    assert result["exit_codes"] == [0, 0, 0], result.get("logs")
    assert [r["token_ids"] for r in result["requests"]] == single_node(prompts)
    totals = result["totals"]
    assert totals["draft_tokens"] > 0
    assert totals["acceptance_rate"] is not None
