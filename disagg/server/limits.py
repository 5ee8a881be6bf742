"""Limits checked before the expensive step of a request (X5b): the body's size before it is
read whole and parsed, and a text prompt's length before it is tokenized.

What is left after these checks (parsing a body within the limit, tokenizing a prompt that
may fit) is bounded by them; the tokenizing itself runs off the event loop (`app.py`).
"""

from __future__ import annotations

from starlette.requests import Request

from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.errors import BodyTooLarge, InvalidRequest


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body of `request`, or `BodyTooLarge` as soon as it is known to exceed `max_bytes`.

    A declared `Content-Length` over the limit is refused before a byte of the body is read;
    a chunked (or lying) body is counted as it arrives and reading stops at the limit, so the
    server holds at most `max_bytes` plus one chunk of it.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def max_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token stands for in a text, from the vocabulary.

    Each token's text alone is at least as long as its share of a longer text: a character
    split over tokens counts once in the text but at least once (as U+FFFD) in the token that
    starts it. The +1 covers decoders that drop a word-start space when a token is decoded
    alone (SentencePiece's "▁"). The bound fails only under a normalizer that deletes input
    characters; none of the tokenizers we load has one.
    """
    longest = max((len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)), default=0)
    return longest + 1


def check_prompt_chars(num_chars: int, max_tokens: int, chars_per_token: int,
                       field: str) -> None:
    """Refuse a text of `num_chars` characters that must tokenize to more than `max_tokens`.

    A text of n characters has at least n / `chars_per_token` tokens (`max_token_chars`), so
    past `max_tokens * chars_per_token` characters it cannot fit, and tokenizing it would only
    cost time. Shorter texts may still not fit: the token count decides those.
    """
    if num_chars > max_tokens * chars_per_token:
        raise InvalidRequest(f"{field} has {num_chars} characters: more than the "
                             f"{max_tokens} tokens that fit, at any tokenization", field)
