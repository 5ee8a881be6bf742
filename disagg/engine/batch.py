"""What one engine step runs: chunks of requests, as the scheduler hands them out (S3a).

The same `Batch` goes to the model runner (what to compute) and, on a prefiller, to the messenger
(which pages of which requests will be ready as each layer finishes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def is_last_prefill_chunk(self) -> bool:
        """Whether the chunk computes the last prompt token (prefill complete after it)."""
        return self.start < self.request.num_prompt_tokens <= self.end


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
