"""The logits processors against the definitions users know: transformers' own processors
for `repetition_penalty` and `min_tokens`, OpenAI's formula for the two penalties."""

from __future__ import annotations

import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from disagg.engine.logits_processors import process_logits
from disagg.engine.sampling_params import SamplingParams
from disagg.errors import RequestError

VOCAB = 64
PROMPT = [3, 5, 5, 9]
OUTPUT = [5, 7, 7, 7, 11]
EOS = (2,)


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers(penalty: float) -> None:
    raw = logits()
    ours = process_logits(raw, SamplingParams(repetition_penalty=penalty), PROMPT, OUTPUT, EOS)
    ids = torch.tensor([PROMPT + OUTPUT])
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, raw[None].clone())[0]
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(("frequency", "presence"), [(0.7, 0.0), (0.0, 1.5), (-1.0, 2.0)])
def test_frequency_and_presence_penalties_follow_openai(frequency: float,
                                                        presence: float) -> None:
    """OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, where c
    counts generated tokens only."""
    raw = logits()
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    ours = process_logits(raw, params, PROMPT, OUTPUT, EOS)
    expected = raw.clone()
    for token in range(VOCAB):
        count = OUTPUT.count(token)
        expected[token] -= count * frequency + (count > 0) * presence
    torch.testing.assert_close(ours, expected)


def test_logit_bias_adds_to_the_named_ids() -> None:
    raw = logits()
    ours = process_logits(raw, SamplingParams(logit_bias=((4, 100.0), (6, -5.5))), PROMPT,
                          OUTPUT, EOS)
    expected = raw.clone()
    expected[4] += 100.0
    expected[6] -= 5.5
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_tokens_is_transformers(generated: int) -> None:
    """EOS is impossible until `min_tokens` were generated, exactly as transformers' processor
    (whose prompt length is skipped) decides."""
    raw = logits()
    output = OUTPUT[:generated]
    ours = process_logits(raw, SamplingParams(min_tokens=3, max_tokens=8), PROMPT, output, EOS)
    processor = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, list(EOS))
    theirs = processor(torch.tensor([PROMPT + output]), raw[None].clone())[0]
    torch.testing.assert_close(ours, theirs)


def test_min_tokens_also_masks_the_stop_token_ids() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(13,))
    shaped = process_logits(logits(), params, PROMPT, [], EOS)
    assert shaped[13] == float("-inf") and shaped[2] == float("-inf")


def test_the_callers_logits_stay_as_they_were() -> None:
    raw = logits()
    before = raw.clone()
    process_logits(raw, SamplingParams(repetition_penalty=2.0, logit_bias=((1, 3.0),)),
                   PROMPT, OUTPUT, EOS)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("fields", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
                                    {"repetition_penalty": 0.0}, {"logit_bias": ((1, 101.0),)},
                                    {"logit_bias": ((-1, 1.0),)}, {"min_tokens": 17},
                                    {"logprobs": 21}, {"n": 0},
                                    {"presence_penalty": float("nan")}])
def test_values_outside_their_range_are_refused(fields: dict[str, object]) -> None:
    name = next(iter(fields))
    with pytest.raises(RequestError, match=name.split("_")[0]):
        SamplingParams(**fields)  # type: ignore[arg-type]
