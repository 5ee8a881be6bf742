"""Which pages to write after each chunk, and how many writes a decoder must expect (S3, S4c).

A page is written once, when it is complete: either all its tokens are computed, or it holds
the last prefilled token. So the number of writes depends only on the prompt length, never on
how the prefiller chunked it, and the decoder can compute its expected count up front.
Writes per request = pages of the prefilled tokens x layers + one context write (S4a, S8).
"""

from __future__ import annotations

CONTEXT_WRITES = 1  # hidden state + logits of the last prefilled position, one slot


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed for `num_tokens` tokens.

    >>> num_pages(17, 16)
    2
    """
    return -(-num_tokens // page_size)


def pages_completed_by_chunk(start: int, end: int, num_prefill_tokens: int,
                             page_size: int) -> range:
    """Indices (into the request's page list) of pages that become complete with tokens
    `[start, end)`: every page whose last slot is in the chunk, plus the final partial page
    when the chunk reaches the last prefilled token.

    >>> list(pages_completed_by_chunk(0, 5, 10, page_size=4))  # page 0 full; page 1 not yet
    [0]
    >>> list(pages_completed_by_chunk(5, 10, 10, page_size=4))  # page 1 full, page 2 is last
    [1, 2]
    """
    first = start // page_size  # pages before it were completed by earlier chunks
    if end >= num_prefill_tokens:
        return range(first, num_pages(num_prefill_tokens, page_size))
    return range(first, end // page_size)


def expected_write_count(num_prompt_tokens: int, page_size: int, num_layers: int) -> int:
    """Writes a decoder counts before a request is ready: the prefill covers every prompt
    token but the last (S8), one write per page per layer, plus the context write.

    >>> expected_write_count(num_prompt_tokens=33, page_size=16, num_layers=30)  # 2 pages
    61
    """
    num_prefill_tokens = num_prompt_tokens - 1
    if num_prefill_tokens <= 0:
        return 0
    return num_pages(num_prefill_tokens, page_size) * num_layers + CONTEXT_WRITES
