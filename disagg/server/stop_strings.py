"""Stop strings: their limits, and a matcher that finds them in streamed text in linear time.
X5b

`StopMatcher` is an Aho-Corasick automaton over the (at most `MAX_STOP_STRINGS`) stop
strings, fed the generated text chunk by chunk. It is not a general multi-pattern search: it
stops at the first stop string to complete and never looks past it.

NOTE on the invariant: after each `feed`, the automaton's state is the longest suffix of the
text fed so far that is a prefix of some stop string. That suffix is exactly what must be held
back (it may still become a stop string); everything before it is safe to emit. Each
character costs one goto step plus failure steps that are paid for by earlier goto steps, so
feeding n characters costs O(n) however the text is chunked and however long the stops are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.server.errors import InvalidRequest

# OpenAI's documented limit on the number of stop sequences.
MAX_STOP_STRINGS = 4
# Ours: a stop string is held back while it may still be forming, so its length bounds how
# far a stream lags behind the decoder; 1,000 characters is longer than any stop marker we
# know of (chat turn markers are a few dozen) and keeps the automaton at 4,000 states at most.
MAX_STOP_CHARS = 1000


def check_stop_strings(stops: list[str]) -> list[str]:
    """`stops` if within the limits, else an `InvalidRequest` naming `stop`."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop sequences (got {len(stops)})",
                             "stop")
    for stop in stops:
        if not stop:
            raise InvalidRequest("a stop sequence is empty", "stop")
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(f"a stop sequence has {len(stop)} characters; at most "
                                 f"{MAX_STOP_CHARS}", "stop")
    return stops


@dataclass(slots=True)
class _State:
    """One trie node: the prefix of length `depth` of some stop string."""

    depth: int
    goto: dict[str, int] = field(default_factory=dict)
    fail: int = 0  # the longest proper suffix of this prefix that is also a prefix
    match: int = 0  # the length of the longest stop string ending here (0: none)


class StopMatcher:
    """Cuts text at the first stop string to complete; holds back a tail that may begin one.

    "First" is by where the stop string ends, so the answer does not depend on how the text
    is chunked: a stream is cut where the decoder would have been stopped token by token. Of
    stop strings ending at the same character, the longest one wins (the cut is earliest).
    `steps` counts automaton transitions, so tests can check the cost is linear.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.steps = 0
        self._states = [_State(0)]
        self._state = 0
        self._pending = ""  # the held-back tail: always the current state's prefix
        for stop in stops:
            self._insert(stop)
        self._link()

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        held = self._pending
        for index, char in enumerate(text):
            self._state = self._next(self._state, char)
            found = self._states[self._state].match
            if found:
                # The stop string ends at `index`: cut where it starts.
                end = len(held) + index + 1
                out = (held + text[:index + 1])[:end - found]
                self._pending, self._state = "", 0
                return out, True
        depth = self._states[self._state].depth
        whole = held + text
        cut = len(whole) - depth
        out, self._pending = whole[:cut], whole[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back tail, once no more text will come."""
        out, self._pending, self._state = self._pending, "", 0
        return out

    def _insert(self, stop: str) -> None:
        state = 0
        for char in stop:
            nxt = self._states[state].goto.get(char)
            if nxt is None:
                nxt = len(self._states)
                self._states.append(_State(self._states[state].depth + 1))
                self._states[state].goto[char] = nxt
            state = nxt
        self._states[state].match = len(stop)

    def _link(self) -> None:
        """Failure links, breadth first: a node's parent is linked before the node."""
        order = list(self._states[0].goto.values())
        for state in order:
            for char, child in self._states[state].goto.items():
                fail = self._next(self._states[state].fail, char) if state else 0
                node = self._states[child]
                node.fail = fail
                # A shorter stop string ending here counts too (its match is inherited).
                node.match = node.match or self._states[fail].match
                order.append(child)

    def _next(self, state: int, char: str) -> int:
        while True:
            self.steps += 1
            nxt = self._states[state].goto.get(char)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = self._states[state].fail
