"""A body's sampling fields fitted for the decoder (`disagg.server.request_params`): the token
budget with `n` choices, and what is refused before anything is submitted."""

from __future__ import annotations

import pytest

from disagg.engine.guide_spec import Guide, GuideKind
from disagg.engine.request import SamplingParams
from disagg.engine.sampling_params import MAX_GUIDE_CHARS
from disagg.errors import GuideError
from disagg.server.errors import InvalidRequest
from disagg.server.request_params import Budget


def test_without_max_tokens_n_choices_share_the_cache() -> None:
    """1000 tokens of cache, a 100-token prompt: one choice may take 900, each of 3 300."""
    budget = Budget(context=2048, cache=1000)
    assert budget.max_tokens(100, None, "max_tokens") == 900
    assert budget.max_tokens(100, None, "max_tokens", n=3) == 300


def test_n_choices_that_cannot_fit_are_refused_naming_max_tokens() -> None:
    budget = Budget(context=2048, cache=1000)
    assert budget.max_tokens(100, 300, "max_tokens", n=3) == 300
    with pytest.raises(InvalidRequest, match="each of n=3") as caught:
        budget.max_tokens(100, 301, "max_tokens", n=3)
    assert caught.value.param == "max_tokens"


def test_a_grammar_too_long_to_compile_on_the_engine_thread_is_refused() -> None:
    with pytest.raises(GuideError, match="at most"):
        SamplingParams(guide=Guide(GuideKind.REGEX, "a" * (MAX_GUIDE_CHARS + 1)))
