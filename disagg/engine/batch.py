"""What one engine step runs and what it produces (S3a).

A `Batch` holds chunks of requests, as the scheduler hands them out; the same batch goes to the
model runner (what to compute) and, on a prefiller, to the messenger (which pages of which
requests will be ready as each layer finishes). `ForwardOutput` is what the forward produced,
`TokenEvent` what a step sampled. Kept here, below the runners, so nothing imports in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from disagg.engine.logprobs import TokenLogprob
from disagg.engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens `[start, start + num_tokens)` of `request`, to be computed in this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        """One past the last position of the chunk."""
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        """A single token after the prompt: an ordinary decode step."""
        return self.num_tokens == 1 and self.start >= self.request.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the request's last token, so a next token is sampled."""
        return self.end == self.request.num_tokens


@dataclass(slots=True)
class Batch:
    """The chunks of one step, in the order their tokens are packed."""

    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens through the dense layers this step (the `qo_len` of S1)."""
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to run."""
        return not self.chunks

    @property
    def is_pure_decode(self) -> bool:
        """Every chunk is a one-token decode."""
        return bool(self.chunks) and all(chunk.num_tokens == 1 for chunk in self.chunks)


@dataclass(slots=True)
class ForwardOutput:
    """What one step produced for the chunks that sample."""

    sample_chunk_indices: list[int]  # index into batch.chunks of each row below
    hidden_states: torch.Tensor  # [num_sampling_chunks, hidden_size], after the final norm
    # [num_sampling_chunks, vocab_size]; None from a prefiller's forward, which never samples
    # and so never runs the LM head (S8)
    logits: torch.Tensor | None
    # Every row of the batch, packed as its chunks: what a prefiller ships for a draft head and
    # what a speculative decoder verifies drafts with (S8). [num_tokens, hidden_size]
    all_hidden_states: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token a step produced for a request; `finished` if it was the request's last."""

    request: Request
    token_id: int
    finished: bool
    logprob: TokenLogprob | None = None  # when the request asks for log probabilities
