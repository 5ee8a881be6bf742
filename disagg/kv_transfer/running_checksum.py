"""A request's KV checksum added up as its layers are posted, off the transfer's tail (X4c, X8d).

The checksum the prefiller packs into the context slot is a sum over layers and tokens
(`kv_checksum.LayerSums`), so it need not wait for the last layer: as the layer poller posts
a layer's writes for a chunk, it adds that layer's part over the chunk's tokens (and, with the
first chunk, the tokens the prefiller found cached). After the last forward only the context
is left to send. Token ranges are planned on the engine thread before each forward (`plan`)
and summed on the poller thread (`add`, `finish`); the engine thread reads the total after the
forward's `wait_posted`, which orders it after every `add`. A request whose ranges do not
cover its prompt (a cache the kernel cannot read in place, say) has no total and the context
sender sums the whole KV, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.kv_transfer.kv_checksum import MASK


@dataclass(slots=True)
class TokenRange:
    """Tokens [start, end) of one chunk, to be summed over every layer."""

    start: int
    end: int


@dataclass(slots=True)
class RunningChecksum:
    """Tokens below `planned` are in some forward's plan; below `summed`, summed over every
    layer into `total`. Starts at the first token the decoder does not hold."""

    planned: int
    summed: int
    total: int = 0

    @classmethod
    def from_token(cls, first: int) -> RunningChecksum:
        return cls(first, first)

    def plan(self, end: int) -> TokenRange | None:
        """Engine thread, before a forward: the range this forward's layers add (None: the
        chunk adds nothing new)."""
        if end <= self.planned:
            return None
        span, self.planned = TokenRange(self.planned, end), end
        return span

    def add(self, part: int) -> None:
        """Poller thread: the part of some layers (those a post carried) of a planned range."""
        self.total = (self.total + part) & MASK

    def finish(self, span: TokenRange) -> None:
        """Poller thread: `span` is summed over every layer."""
        self.summed = max(self.summed, span.end)

    def value(self, num_tokens: int) -> float | None:
        """The checksum of the first `num_tokens` tokens, if every one of them was summed.

        >>> c = RunningChecksum.from_token(4)
        >>> span = c.plan(9); c.add(5); c.add(7); c.finish(span)
        >>> c.value(9), c.value(12)
        (12.0, None)
        """
        return float(self.total) if self.summed == num_tokens else None
