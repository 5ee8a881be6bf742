"""Stop strings (`disagg.server.stop_strings`): the matcher against a naive reference over
any chunking, its linear cost, and the limits on count and length (X5b)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.server.errors import InvalidRequest
from disagg.server.stop_strings import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    StopMatcher,
    check_stop_strings,
)
from tests.disagg.server.app_harness import FakeRouter, post, running_app


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string to complete (the longest if several end at
    once), scanning end positions one by one: quadratic, obviously right."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))], True
    return text, False


def run(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    """Feed `chunks`, checking that nothing emitted could still begin a stop string."""
    matcher, out = StopMatcher(stops), ""
    for chunk in chunks:
        emitted, stopped = matcher.feed(chunk)
        out += emitted
        if stopped:
            return out, True
    return out + matcher.flush(), False


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


ALPHABET = st.sampled_from("abc")
STOPS = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(stops=STOPS, text=st.text(ALPHABET, max_size=40), cuts=st.lists(st.integers(0, 40)))
def test_matches_the_reference_over_any_chunking(stops: list[str], text: str,
                                                 cuts: list[int]) -> None:
    """Overlapping stops, stops spanning chunk boundaries: the answer is the reference's."""
    assert run(stops, split(text, cuts)) == reference(text, stops)


@settings(max_examples=200, deadline=None)
@given(stops=STOPS, text=st.text(ALPHABET, max_size=40))
def test_only_a_possible_stop_start_is_held_back(stops: list[str], text: str) -> None:
    """Fed character by character, the held-back tail is exactly the longest suffix of the
    text so far that may still grow into a stop string: no more, no less."""
    matcher, out = StopMatcher(stops), ""
    for end in range(1, len(text) + 1):
        emitted, stopped = matcher.feed(text[end - 1])
        out += emitted
        if stopped:
            return
        fed = text[:end]
        longest = max(k for s in stops for k in range(len(s)) if fed.endswith(s[:k]))
        assert out == fed[:len(fed) - longest]


def test_the_first_stop_to_complete_wins_over_an_earlier_start() -> None:
    """"bc" completes before "abcd" could: the cut is there, whatever the chunking."""
    assert run(["abcd", "bc"], ["abcd"]) == ("a", True)
    assert run(["abcd", "bc"], ["a", "b", "c", "d"]) == ("a", True)


def test_of_stops_ending_together_the_longest_cuts() -> None:
    assert run(["c", "abc"], ["xab", "c"]) == ("x", True)


def test_text_before_the_stop_is_returned_exactly() -> None:
    assert run(["<|end|>"], ["héllo <|e", "nd|> more"]) == ("héllo ", True)


def test_a_held_tail_that_never_completes_is_flushed() -> None:
    assert run(["STOP"], ["hello ST", "OR"]) == ("hello STOR", False)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_cost_is_linear_in_the_text_for_adversarial_stops(chunk: int) -> None:
    """Four long stops that almost match everywhere: a naive matcher compares each held tail
    against every stop on every feed (about text x stop length); this one takes a bounded
    number of steps per character."""
    stops = ["a" * (MAX_STOP_CHARS - 1) + end for end in "bcde"]
    text = "a" * 20_000
    matcher = StopMatcher(stops)
    built = matcher.steps
    for start in range(0, len(text), chunk):
        matcher.feed(text[start:start + chunk])
    assert matcher.steps - built <= 2 * len(text)


def test_building_the_automaton_is_linear_in_the_stops() -> None:
    stops = ["ab" * (MAX_STOP_CHARS // 2), "ba" * (MAX_STOP_CHARS // 2)]
    assert StopMatcher(stops).steps <= 2 * sum(map(len, stops))


def test_too_many_stops_is_refused_naming_stop() -> None:
    with pytest.raises(InvalidRequest, match="at most 4") as error:
        check_stop_strings(["x"] * (MAX_STOP_STRINGS + 1))
    assert error.value.param == "stop"


def test_a_too_long_stop_is_refused_naming_stop() -> None:
    with pytest.raises(InvalidRequest, match="characters") as error:
        check_stop_strings(["x" * (MAX_STOP_CHARS + 1)])
    assert error.value.param == "stop"


def test_an_empty_stop_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        check_stop_strings([""])


def test_four_huge_stops_over_http_are_a_400_before_any_submit() -> None:
    """The request that froze the front door for 53 s: four 300,000-character stops."""
    router = FakeRouter()
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "stop": ["ab" * 150_000] * 4}
    with running_app(router) as (address, _):
        status, reply = post(address, "/v1/completions", body)
    assert status == 400
    assert reply["error"]["param"] == "stop"
    assert router.submitted == []
