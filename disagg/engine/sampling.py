"""Turning logits into next tokens: greedy, temperature, top-k, top-p, seeded per request (S1,
X5a).

Only decoders and single-node engines sample; a prefiller never does (S8). NOTE on the
invariant (X5a): for every value `SamplingParams` accepts and any logits (huge, +-inf, NaN),
`token_probs` returns finite probabilities summing to 1 in which the most likely token has
mass, so `draw_token` always has something to draw. Filtering works in float64 on logits
shifted so that their maximum is 0: a temperature of 1e300 or a `top_p` of 1e-300 (both 0 or
inf in float32) keep their meaning, and the top token is kept by construction, never by a
comparison that rounding can flip.
"""

from __future__ import annotations

import torch

from disagg.engine.request import SamplingParams
from disagg.model.logits_argmax import argmax


def shift_logits(logits: torch.Tensor) -> torch.Tensor:
    """``[..., vocab_size]`` logits as float64 whose row maximum is 0, every entry finite or
    -inf. NaN counts as -inf (never drawn); where a row has +inf entries those alone remain
    (each 0), the limit of their probabilities; a row with nothing finite becomes uniform."""
    logits = logits.double()
    logits = torch.where(logits.isnan(), float("-inf"), logits)
    posinf = logits == float("inf")
    logits = torch.where(posinf.any(-1, keepdim=True),
                         torch.where(posinf, 0.0, float("-inf")).to(logits), logits)
    row_max = logits.amax(-1, keepdim=True)
    # A row of -inf only (every logit NaN or -inf): no token is likelier than another.
    logits = torch.where(row_max == float("-inf"), torch.zeros_like(logits), logits)
    return logits - logits.amax(-1, keepdim=True)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float,
                      rank: torch.Tensor | None = None) -> torch.Tensor:
    """Mask all but the `top_k` largest logits and the smallest set with mass >= `top_p`.

    `logits` is ``[vocab_size]`` or ``[rows, vocab_size]``; masked entries become -inf.
    `rank` (same order as `logits`, finer where they tie: the logits before temperature)
    decides which tokens count as largest. The largest of a row is never masked, whatever
    `top_k` and `top_p` (X5a).
    """
    rank = logits if rank is None else rank
    vocab_size = logits.shape[-1]
    if top_k and top_k < vocab_size:
        kth = torch.topk(rank, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(rank < kth, float("-inf"))
        rank = rank.masked_fill(rank < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.sort(rank, dim=-1, descending=True, stable=True).indices
        sorted_logits = logits.gather(-1, order)
        probs = sorted_logits.double().softmax(-1)
        # Drop a token when the mass before it already reaches top_p. The first (the largest)
        # always stays: set explicitly, so no rounding of a tiny top_p can drop it.
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What `sample_token` draws from: ``[..., vocab_size]`` logits to float64 probabilities
    after temperature, top-k and top-p; one-hot on the argmax when greedy."""
    if params.temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    # Shift first, then divide: (x - max) / T is <= 0 and finite or -inf for any T >= 1e-5.
    shifted = shift_logits(logits)
    scaled = shifted / params.temperature
    # A huge temperature can round a near-top logit to the top's 0: ranked by the unscaled
    # logits, that tie cannot keep it in place of the real top (X5a).
    return apply_top_k_top_p(scaled, params.top_k, params.top_p, rank=shifted).softmax(-1)


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> int:
    """One token id from ``[vocab_size]`` logits; greedy is exactly the argmax."""
    if params.temperature == 0.0:
        return argmax(logits)
    return draw_token(token_probs(logits, params), generator)


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from ``[vocab_size]`` probabilities, with the request's generator.

    A seeded request's generator lives on the CPU (`Request`), and `multinomial` refuses a
    generator of another device: GPU probabilities are drawn on the CPU, which also keeps a
    seed's tokens the same whichever device the engine runs on.
    """
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))
