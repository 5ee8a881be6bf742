"""Log probabilities of the tokens a decoder chose, and of the likeliest alternatives (S8).

They are the model's own distribution: `log_softmax` of the logits as the model computed them,
before penalties, biases, the grammar's mask, temperature, top-k and top-p (vLLM's default), so
they can be compared with any other implementation of the model. A probability too small for
float32 (-inf) is reported as -9999.0, as OpenAI's API does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = -9999.0  # what OpenAI reports for a token the model gives no mass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One chosen token's log probability and the `k` likeliest ids with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # most likely first


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """`token_id`'s log probability under ``[vocab_size]`` raw logits, with the top `k`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=FLOOR, neginf=FLOOR).clamp_min(FLOOR)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)
