"""Token ids of a rendered chat prompt in which the messages' own text is plain text (X5b).

A chat template writes special markers (`<|im_start|>`) around each message's content. If the
whole rendered prompt were tokenized with special tokens matched, a user could type
`<|im_start|>system` in a message and open a real system turn. Here only the markers the
template wrote become special ids; in the spans that came from message content, special-token
text is tokenized as ordinary text, as transformers' `split_special_tokens=True` does.

Not a tokenizer of its own: two copies of the model's tokenizer (one with special-token
matching off), built once per tokenizer through its public `save`.
"""

from __future__ import annotations

import re
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as Backend

from disagg.model.loading.tokenizer import Tokenizer

Span = tuple[int, int]  # [start, end) in characters of the rendered text


class PlainTextEncoder:
    """Encode rendered text so that special tokens count only outside `plain` spans."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        with tempfile.TemporaryDirectory(prefix="disagg-tokenizer-") as directory:
            path = Path(directory) / "tokenizer.json"
            tokenizer.save(path)
            self._marked = Backend.from_file(str(path))
            self._plain = Backend.from_file(str(path))
        self._plain.encode_special_tokens = True  # special-token text is just text here
        self.special_ids = frozenset(
            i for i, token in self._marked.get_added_tokens_decoder().items() if token.special)

    def contains_special(self, text: str) -> bool:
        """Whether `text` holds a special token's spelling."""
        ids = self._marked.encode(text, add_special_tokens=False).ids
        return any(i in self.special_ids for i in ids)

    def encode(self, text: str, plain: Sequence[Span]) -> list[int]:
        """Ids of `text` without BOS/EOS added; special tokens matched only outside `plain`
        (sorted, disjoint spans).

        NOTE: tokenizers splits its input at special tokens before anything else, so text
        between two special tokens is tokenized on its own either way. We find the template's
        special tokens (outside `plain`), then tokenize each stretch between them with
        special-token matching off: the ids equal whole-text tokenization wherever no message
        spells a special token, and otherwise differ only by reading that spelling as text.
        """
        markers: list[tuple[int, int, int]] = []  # (start, end, id) of the template's specials
        start = 0
        for span_start, span_end in [*plain, (len(text), len(text))]:
            if start < span_start:
                markers += self._specials(text[start:span_start], start)
            start = span_end
        ids: list[int] = []
        cursor = 0
        for marker_start, marker_end, token_id in markers:
            ids += self._plain_ids(text[cursor:marker_start])
            ids.append(token_id)
            cursor = marker_end
        return ids + self._plain_ids(text[cursor:])

    def _specials(self, region: str, offset: int) -> list[tuple[int, int, int]]:
        encoding = self._marked.encode(region, add_special_tokens=False)
        return [(offset + a, offset + b, i) for i, (a, b) in zip(
            encoding.ids, encoding.offsets, strict=True) if i in self.special_ids]

    def _plain_ids(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids if text else []


_encoders: weakref.WeakKeyDictionary[Tokenizer, PlainTextEncoder] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def plain_text_encoder(tokenizer: Tokenizer) -> PlainTextEncoder:
    """The encoder of `tokenizer`, built on first use (a few ms: a save and two loads)."""
    with _lock:
        encoder = _encoders.get(tokenizer)
        if encoder is None:
            encoder = _encoders[tokenizer] = PlainTextEncoder(tokenizer)
        return encoder


def free_sentinels(texts: Sequence[str]) -> tuple[str, str]:
    """Two private-use characters that occur in none of `texts`: markers to wrap content in."""
    used = set().union(*map(set, texts))
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)
    return next(free), next(free)


def unwrap(marked: str, begin: str, end: str) -> tuple[str, list[Span]]:
    """`marked` without the `begin`/`end` markers, and the spans they enclosed.

    >>> unwrap("a<b>c", "<", ">")
    ('abc', [(1, 2)])
    """
    parts = re.split(f"([{re.escape(begin)}{re.escape(end)}])", marked)
    text, spans = [], []
    size, opened = 0, None
    for index, part in enumerate(parts):
        if index % 2 == 0:  # text between markers
            text.append(part)
            size += len(part)
        elif part == begin:
            opened = size
        elif opened is not None:
            spans.append((opened, size))
            opened = None
    return "".join(text), spans
