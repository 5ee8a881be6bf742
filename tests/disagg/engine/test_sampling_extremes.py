"""Sampling cannot fail on any accepted value (X5a): tiny top_p, huge temperature, +-inf logits."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.engine.request import Request, SamplingParams
from disagg.engine.sampling import sample_token, token_probs
from disagg.speculative.verify import propose_token, verify_sampled

INF = float("inf")
# The extremes `SamplingParams` accepts, plus ordinary values between them.
TEMPERATURES = st.one_of(st.sampled_from([0.0, 1e-300, 1e-5, 1.0, 1e300, 1.7976931348623157e308]),
                         st.floats(0, 1e308))
TOP_PS = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1.0]),
                   st.floats(5e-324, 1.0))
TOP_KS = st.one_of(st.sampled_from([0, 1, 2, 10**9, 2**62]), st.integers(0, 80))
SEEDS = st.one_of(st.none(), st.sampled_from([0, 2**63 - 1]), st.integers(0, 2**63 - 1))
LOGIT = st.one_of(st.sampled_from([INF, -INF, math.nan, 3.4e38, -3.4e38, 0.0]),
                  st.floats(width=32))
LOGITS = st.lists(LOGIT, min_size=1, max_size=48)
# [k + 1, vocab_size] rows of one speculative chunk.
CHUNK_LOGITS = st.integers(1, 24).flatmap(lambda vocab_size: st.lists(
    st.lists(LOGIT, min_size=vocab_size, max_size=vocab_size), min_size=2, max_size=4))
PARAMS = st.builds(SamplingParams, temperature=TEMPERATURES, top_p=TOP_PS, top_k=TOP_KS,
                   seed=SEEDS)


def _top_tokens(logits: torch.Tensor) -> set[int]:
    """The most likely tokens: the largest logit (NaN counts as -inf; all -inf: every one)."""
    values = torch.where(logits.isnan(), -INF, logits.double())
    return set(torch.nonzero(values == values.max()).flatten().tolist())


def test_tiny_top_p_samples_the_argmax() -> None:
    """top_p=1e-300 is 0 in float32, which masked every token and crashed multinomial: it now
    keeps exactly the most likely token."""
    logits = torch.tensor([0.5, 2.0, -1.0, 1.9])
    params = SamplingParams(temperature=1.0, top_p=1e-300)
    draws = {sample_token(logits, params, torch.Generator().manual_seed(s)) for s in range(20)}
    assert draws == {1}


def test_huge_temperature_is_uniform_over_finite_tokens() -> None:
    """temperature 1e300 (inf in float32) flattens the distribution instead of making NaN."""
    probs = token_probs(torch.tensor([3.0, -INF, 1.0, 0.0]), SamplingParams(temperature=1e300))
    torch.testing.assert_close(probs, torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3]).double())


def test_infinite_logits_are_the_only_candidates() -> None:
    """+inf logits take all the mass (shared among them); NaN logits take none."""
    probs = token_probs(torch.tensor([1.0, INF, math.nan, INF, 3e38]),
                        SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]).double())


def test_no_finite_logit_still_draws_a_token() -> None:
    """Logits that are all -inf or NaN leave no likelier token: the draw is uniform."""
    logits = torch.tensor([-INF, math.nan, -INF])
    assert 0 <= sample_token(logits, SamplingParams(temperature=0.8, top_p=0.1)) < 3


def test_greedy_is_exactly_argmax_on_extreme_logits() -> None:
    """Greedy stays `argmax` of the logits as given, huge values included."""
    logits = torch.tensor([-3.4e38, 3.4e38, 3.3e38, 0.0])
    assert sample_token(logits, SamplingParams(temperature=0.0, top_p=1e-300, top_k=1)) == 1


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(LOGITS, PARAMS), min_size=1, max_size=6))
def test_any_accepted_params_sample_a_top_token_candidate(
        rows: list[tuple[list[float], SamplingParams]]) -> None:
    """A batch of rows with mixed extreme params: every row's distribution is finite, sums to
    1 and gives the top token mass; the drawn id is in range; greedy is the argmax; a tiny
    top_p or top_k 1 draws a top token itself."""
    for values, params in rows:
        logits = torch.tensor(values, dtype=torch.float32)
        generator = Request("r", [1], params).generator
        probs = token_probs(logits, params)
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-9)
        token = sample_token(logits, params, generator)
        assert 0 <= token < len(values)
        if params.temperature == 0.0:  # greedy is argmax as torch defines it (NaN included)
            assert token == int(torch.argmax(logits)) and float(probs[token]) == 1.0
            continue
        top = _top_tokens(logits)
        assert any(float(probs[i]) > 0 for i in top)
        if params.top_p < 1e-30 or params.top_k == 1:
            assert token in top


@settings(max_examples=150, deadline=None)
@given(values=CHUNK_LOGITS, params=PARAMS)
def test_speculative_drafts_and_verification_never_fail(values: list[list[float]],
                                                        params: SamplingParams) -> None:
    """The speculative path (one distribution per draft row, rejection sampling) draws valid
    ids for the same extremes."""
    logits = torch.tensor(values, dtype=torch.float32)  # [k + 1, vocab_size]
    generator = torch.Generator().manual_seed(0)
    drafts, draft_probs = [], []
    for row in logits[:-1]:
        token, q = propose_token(row, params, generator)
        drafts.append(token)
        draft_probs.append(q)
    if params.temperature == 0.0:
        return  # greedy verification compares argmaxes: nothing is drawn
    tokens = verify_sampled(drafts, torch.stack(draft_probs), token_probs(logits, params),
                            generator)
    assert 1 <= len(tokens) <= len(values)
    assert all(0 <= token < logits.shape[-1] for token in tokens)
