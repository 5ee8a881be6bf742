"""Checking draft tokens against one target forward: greedy prefix match or rejection sampling.

Pure functions, no model: the engine hands in the target's logits for the k + 1 positions of a
speculative chunk (the last real token, then the k drafts) and gets back the tokens to append.
Greedy keeps the longest prefix of drafts equal to the target's argmax, then adds the target's
own next token, so the output is token for token the non-speculative one. With sampling, each
draft is accepted with probability min(1, p / q) and a rejection resamples from max(0, p - q)
(Leviathan et al. 2023, Chen et al. 2023), so every appended token is distributed exactly as
`sampling.sample_token` would have drawn it: `token_probs` is the sampler's own (re-exported
here), which cannot fail on any accepted value (X5a). Decoders only; a prefiller never
samples (S8).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disagg.engine.request import SamplingParams
from disagg.engine.sampling import draw_token, token_probs

__all__ = ["propose_token", "token_probs", "verify", "verify_greedy", "verify_greedy_lazily",
           "verify_sampled"]


def verify_greedy(draft_token_ids: list[int], target_logits: torch.Tensor) -> list[int]:
    """Tokens to append after a greedy speculative chunk.

    `target_logits` is ``[k + 1, vocab_size]``: row j predicts the token after draft j (row 0,
    the token after the last real token). Returns the accepted drafts plus one target token.

    >>> logits = torch.eye(4)[[2, 3, 1]]  # the target says 2, then 3, then 1
    >>> verify_greedy([2, 0], logits)  # first draft agrees, second does not: 2, then 3
    [2, 3]
    >>> verify_greedy([2, 3], logits)  # both agree: both, plus a bonus token
    [2, 3, 1]
    """
    return verify_greedy_lazily(draft_token_ids, lambda row: int(target_logits[row].argmax()))


def verify_greedy_lazily(draft_token_ids: list[int], target_token: Callable[[int], int]
                         ) -> list[int]:
    """`verify_greedy` asking `target_token(j)` (the target's argmax at row j) only for the
    rows it needs: a decoder computes the LM head for accepted rows plus one, not for all
    k + 1 (the LM head is a fifth of SmolLM2's decode step)."""
    accepted = []
    for row, draft in enumerate(draft_token_ids):
        token = target_token(row)
        if token != draft:
            return [*accepted, token]
        accepted.append(draft)
    return [*accepted, target_token(len(draft_token_ids))]


def verify_sampled(draft_token_ids: list[int], draft_probs: torch.Tensor,
                   target_probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """Tokens to append after a sampled speculative chunk (rejection sampling).

    `draft_probs` is ``[k, vocab_size]``, the distribution each draft was drawn from;
    `target_probs` is ``[k + 1, vocab_size]`` (see `token_probs`). Draft j is kept with
    probability min(1, p(d) / q(d)); the first rejection is replaced by a draw from the
    normalised max(0, p - q) and ends the chunk; if all are kept, one more token comes from p.
    """
    accepted = []
    for j, token in enumerate(draft_token_ids):
        p, q = target_probs[j], draft_probs[j]
        # u < p/q, written without the division (q[token] > 0: the draft drew it).
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            accepted.append(token)
            continue
        residual = (p - q).clamp_min(0)
        total = float(residual.sum())
        # p == q leaves no residual mass; then p itself is the right distribution.
        return [*accepted, draw_token(residual / total if total > 0 else p, generator)]
    return [*accepted, draw_token(target_probs[len(draft_token_ids)], generator)]


def verify(draft_token_ids: list[int], draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """Greedy or rejection sampling, as `params` asks; see `verify_greedy`, `verify_sampled`."""
    if params.temperature == 0.0:
        return verify_greedy(draft_token_ids, target_logits)
    assert draft_probs is not None, "sampled drafts need the distribution they came from"
    return verify_sampled(draft_token_ids, draft_probs, token_probs(target_logits, params),
                          generator)


def propose_token(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """A draft token from ``[vocab_size]`` draft logits, with the distribution it came from
    (the same temperature, top-k and top-p as the target's, so acceptance stays high)."""
    probs = token_probs(logits[None], params)[0]
    if params.temperature == 0.0:
        return int(logits.argmax()), probs
    return draw_token(probs, generator), probs
