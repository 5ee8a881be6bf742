"""The request lifecycle vocabulary: one enum of states, one terminal set (S2)."""

from __future__ import annotations

import pytest

from disagg.engine.request import TERMINAL_STATES, Request, RequestState, SamplingParams


def test_terminal_states_are_the_finished_ones() -> None:
    """Every FINISHED_* state is terminal and nothing else is: a request in any other state
    still has a step, a transfer or a wait ahead of it."""
    finished = {s for s in RequestState if s.name.startswith("FINISHED_")}
    assert finished == TERMINAL_STATES
    assert {s for s in RequestState if s.is_terminal()} == finished


@pytest.mark.parametrize(("tokens", "state"), [
    ([5], RequestState.RUNNING),
    ([5, 6, 7], RequestState.FINISHED_LENGTH),
    ([5, 2], RequestState.FINISHED_STOPPED),  # 2 is an EOS token
])
def test_appending_tokens_finishes_by_length_or_eos(tokens: list[int],
                                                     state: RequestState) -> None:
    request = Request("r", [1], SamplingParams(max_tokens=3), eos_token_ids=(2,))
    request.state = RequestState.RUNNING
    for token in tokens:
        request.append_token(token)
    assert request.state is state
    assert request.is_finished == state.is_terminal()


@pytest.mark.parametrize(("fields", "message"), [
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"temperature": float("inf")}, "temperature must be finite"),
    ({"seed": 2**70}, "seed must be in"),
    ({"seed": -1}, "seed must be in"),
    ({"max_tokens": 0}, "max_tokens must be positive"),
])
def test_sampling_values_no_sampler_can_take_are_refused(fields: dict, message: str) -> None:
    from disagg.errors import RequestError

    with pytest.raises(RequestError, match=message):
        SamplingParams(**fields)


def test_a_vanishing_temperature_samples_greedily() -> None:
    """Logits / 1e-300 overflow to inf (softmax NaN): such a temperature is greedy."""
    import torch

    from disagg.engine.sampling import sample_token

    params = SamplingParams(temperature=1e-300, seed=3)
    assert params.temperature == 0.0
    logits = torch.tensor([0.1, 2.0, 1.9])
    assert sample_token(logits, params, torch.Generator().manual_seed(3)) == 1


def test_token_ids_are_the_joined_lists_slices_of_every_range() -> None:
    """Prompt, generated tokens and drafts read as one list, whatever range crosses them."""
    request = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=9))
    request.output_token_ids = [5, 6, 7]
    request.spec_token_ids = [8, 9]
    joined = request.all_token_ids + request.spec_token_ids
    for start in range(len(joined) + 1):
        for end in range(start, len(joined) + 3):
            assert request.token_ids(start, end) == joined[start:end], (start, end)
    assert request.last_token_id == 7


def test_the_last_token_of_a_request_yet_to_generate_is_its_prompts() -> None:
    assert Request("r", [1, 2, 3], SamplingParams()).last_token_id == 3
