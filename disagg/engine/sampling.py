"""Turning logits into next tokens: greedy, temperature, top-k, top-p, seeded per request.

Only decoders and single-node engines sample; a prefiller never does (S8).
"""

from __future__ import annotations

import torch

from disagg.engine.request import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask all but the `top_k` largest logits and the smallest set with mass >= `top_p`.

    `logits` is ``[vocab_size]``; masked entries become -inf.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> int:
    """One token id from ``[vocab_size]`` logits."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = apply_top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p)
    return draw_token(logits.softmax(-1), generator)


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from ``[vocab_size]`` probabilities, with the request's generator.

    A seeded request's generator lives on the CPU (`Request`), and `multinomial` refuses a
    generator of another device: GPU probabilities are drawn on the CPU, which also keeps a
    seed's tokens the same whichever device the engine runs on.
    """
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))
