"""Speculative decoding on one node: same greedy tokens, rollback without leaks (S8).

The reference is the same engine without speculation. Drafts from the real proposers (early
exit, random MTP head) are mostly wrong on random weights, so an oracle wrapper also feeds
drafts taken from the reference output, with chosen mistakes: that drives the long-accept,
stop-inside-a-chunk and MTP catch-up paths. After every step the allocator books must balance
and a decoding request must hold exactly the pages of its next forward.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import Request, SamplingParams
from disagg.model.draft_heads import Span, build_mtp_head, mtp_kv_cache, span_metadata
from disagg.model.loading.registry import init_random_weights
from disagg.speculative.proposers import CatchUp, MTPProposer, mtp_catch_up
from disagg.speculative.speculator import Speculator, build_speculative_engine

CONFIG = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(CONFIG, seed=0)
PROMPT_LENGTHS = [1, 5, 17, 40]
MAX_TOKENS = 16


def make_engine(kv_layout: str = "NHD", num_pages: int = 256, chunk_size: int = 7,
                spec: SpeculativeConfig | None = None) -> LLMEngine:
    config = EngineConfig(
        CONFIG, CacheConfig(page_size=4, num_pages=num_pages, kv_layout=kv_layout),
        SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=32))
    if spec is None:
        return build_engine(config, WEIGHTS)
    return build_speculative_engine(config, WEIGHTS, spec)


def prompts(lengths: list[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CONFIG.vocab_size, (n,), generator=generator).tolist()
            for n in lengths]


def check_books(engine: LLMEngine) -> None:
    """Allocator invariants; a decoding request holds no page past its next forward's, and
    all of them when it has drafts (they wrote their K/V there)."""
    engine.allocator.check_invariants()
    for r in engine.scheduler.running:
        if r.num_computed_tokens == r.num_tokens - 1:
            needed = -(-(r.num_tokens + len(r.spec_token_ids)) // engine.kv_cache.page_size)
            assert len(r.page_ids) <= needed, (r.request_id, len(r.page_ids), needed)
            assert not r.spec_token_ids or len(r.page_ids) == needed


def run(engine: LLMEngine, batch: list[list[int]], params: SamplingParams | None = None
        ) -> list[list[int]]:
    """Serve `batch` to completion, checking the books after every step."""
    params = params or SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in batch]
    while engine.has_unfinished():
        engine.step()
        check_books(engine)
    engine.allocator.check_invariants(expect_all_free=True)
    return [r.output_token_ids for r in requests]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    """Greedy tokens of `prompts()` without speculation, per layout."""
    return {layout: run(make_engine(layout), prompts()) for layout in ("NHD", "HND")}


def truth(reference: dict[str, list[list[int]]]) -> dict[tuple[int, ...], list[int]]:
    return dict(zip(map(tuple, prompts()), reference["NHD"], strict=True))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", ["early-exit", "mtp"])
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2,
                               pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_tokens_equal_non_speculative(kv_layout: str, kind: str, k: int,
                                             reference: dict[str, list[list[int]]]) -> None:
    """Every draft kind and count, both layouts, chunked prompts: the reference tokens."""
    engine = make_engine(kv_layout, spec=SpeculativeConfig(kind, k, draft_layers=1))
    assert run(engine, prompts()) == reference[kv_layout]
    assert engine.finisher is not None


def test_early_exit_accepts_some_drafts_and_saves_forwards() -> None:
    """On this model the one-layer draft is often right: fewer forwards than tokens."""
    engine = make_engine(spec=SpeculativeConfig("early-exit", 3, draft_layers=1))
    run(engine, prompts())
    stats = speculator(engine).stats
    assert stats.accepted > 0
    assert stats.tokens_per_forward > 1.0


def speculator(engine: LLMEngine) -> Speculator:
    assert isinstance(engine.finisher, Speculator)
    return engine.finisher


class Oracle:
    """Replaces a proposer's drafts with the reference continuation, wrong at chosen output
    indices (the real proposer still runs, so its K/V writes happen as usual)."""

    def __init__(self, engine: LLMEngine, reference: dict[tuple[int, ...], list[int]],
                 wrong_at: Callable[[int], bool] = lambda index: False) -> None:
        self.inner = speculator(engine).proposer
        self.reference, self.wrong_at = reference, wrong_at
        speculator(engine).proposer = self  # type: ignore[assignment]

    def observe(self, *args: object) -> None:
        self.inner.observe(*args)  # type: ignore[arg-type]

    def propose(self, requests: list[Request], num_drafts: list[int],
                choose: Callable[[int, torch.Tensor], int]) -> list[list[int]]:
        drafts = self.inner.propose(requests, num_drafts, choose)
        for request, tokens in zip(requests, drafts, strict=True):
            start = len(request.output_token_ids)
            truth = self.reference[tuple(request.prompt_token_ids)][start:start + len(tokens)]
            tokens[:] = [(t + 1) % CONFIG.vocab_size if self.wrong_at(start + i) else t
                         for i, t in enumerate(truth)]
        return drafts


@pytest.mark.parametrize("kind", ["early-exit", "mtp"])
def test_oracle_drafts_are_all_accepted(kind: str,
                                        reference: dict[str, list[list[int]]]) -> None:
    """Perfect drafts: every one accepted, k + 1 tokens per verify forward, same tokens."""
    engine = make_engine(spec=SpeculativeConfig(kind, 3, draft_layers=1))
    Oracle(engine, truth(reference))
    assert run(engine, prompts()) == reference["NHD"]
    stats = speculator(engine).stats
    assert stats.accepted == stats.drafted > 0


@pytest.mark.parametrize("kind", ["early-exit", "mtp"])
def test_partial_acceptance_rolls_back_cleanly(kind: str,
                                               reference: dict[str, list[list[int]]]) -> None:
    """Every third output is drafted wrong: accepts of every length, rollbacks, same tokens."""
    engine = make_engine(spec=SpeculativeConfig(kind, 4, draft_layers=1))
    Oracle(engine, truth(reference), wrong_at=lambda index: index % 3 == 2)
    assert run(engine, prompts()) == reference["NHD"]
    stats = speculator(engine).stats
    assert 0 < stats.accepted < stats.drafted


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(
        reference: dict[str, list[list[int]]]) -> None:
    """Drafts past a stop token are dropped: the request ends where the reference ends."""
    batch, full = prompts()[1:2], reference["NHD"][1]
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(full[5],))
    expected = run(make_engine(), batch, params)
    engine = make_engine(spec=SpeculativeConfig("early-exit", 4, draft_layers=1))
    Oracle(engine, {tuple(batch[0]): full})
    assert run(engine, batch, params) == expected
    assert expected[0][-1] == full[5]
    assert len(expected[0]) < MAX_TOKENS


def test_few_free_pages_shrink_drafts_and_preempt_without_leaks() -> None:
    """A cache too small for every request at once: drafts shrink, requests are preempted
    and recomputed, and the tokens are still the reference's."""
    batch = prompts([10, 12, 14, 9], seed=3)
    expected = run(make_engine(num_pages=16), batch)
    engine = make_engine(num_pages=16, spec=SpeculativeConfig("mtp", 4))
    assert run(engine, batch) == expected
    engine = make_engine(num_pages=16, spec=SpeculativeConfig("early-exit", 4, draft_layers=1))
    assert run(engine, batch) == expected


def test_mtp_cache_matches_a_fresh_catch_up_over_the_final_tokens() -> None:
    """After rollbacks, the MTP head's cache below `done` equals running the head once over
    the confirmed sequence with the target's own hidden states (no stale draft K/V)."""
    batch = prompts([11])
    engine = make_engine(spec=SpeculativeConfig("mtp", 3))
    Oracle(engine, {tuple(batch[0]): run(make_engine(), batch)[0]},
           wrong_at=lambda index: index % 4 == 1)
    request = engine.add_request(batch[0], SamplingParams(max_tokens=MAX_TOKENS,
                                                          ignore_eos=True))
    for _ in range(6):
        engine.step()
    proposer = speculator(engine).proposer.inner  # type: ignore[attr-defined]
    assert isinstance(proposer, MTPProposer)
    done = proposer.states[request].done
    tokens = request.all_token_ids[:done + 1]
    # The target's hidden states of the confirmed tokens, from a fresh prefill.
    fresh = make_engine(chunk_size=64)
    fresh.add_request(tokens[:done], SamplingParams(max_tokens=1))
    prefill = fresh.scheduler.schedule()
    hidden = fresh.runner.execute(prefill).all_hidden_states
    assert hidden is not None
    page_ids = prefill.chunks[0].request.page_ids
    cache = mtp_kv_cache(CONFIG, CacheConfig(page_size=4, num_pages=256), "cpu")
    mtp_catch_up(build_mtp_head(CONFIG), fresh.model, cache,
                 [CatchUp(page_ids, 0, hidden, tokens[1:done + 1])])
    ours_cache = speculator(engine).kv_cache
    assert ours_cache is not None
    assert done > 12
    ours = ours_cache.gather(0, torch.tensor(request.page_ids), done)
    theirs = cache.gather(0, torch.tensor(page_ids), done)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_span_metadata_packs_like_the_runner() -> None:
    """Single-token spans of several requests get the padded decode table the runner builds."""
    positions, meta = span_metadata([Span([3, 1], 5, 1), Span([2], 0, 1)], 4, torch.device("cpu"))
    assert positions.tolist() == [5, 0]
    assert meta.slot_page_ids.tolist() == [1, 2]
    assert meta.slot_offsets.tolist() == [1, 0]
    assert meta.decode_page_table is not None
    assert meta.decode_page_table.tolist() == [[3, 1],
                                                                                      [2, 0]]
