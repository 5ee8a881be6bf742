"""`n` parallel samples of one prompt: one prefill, then `n` decode streams forked from its
pages (OpenAI's `n`; S1, S8, X2a).

A request asking for `n > 1` is prefilled to all but its last prompt token, once (a decoder
gets exactly that from its prefiller, S8). The scheduler then replaces it with `n` forks, each
of which runs the last prompt token as its first decode step. This file builds the forks; the
scheduler decides when (`Scheduler.schedule`) and keeps the parent to find them by.
It is not copy-on-write: the one page that would be written by several forks is copied up front.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import replace

from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import Request, RequestState

CopyPage = Callable[[int, int], None]  # (src, dst): every layer's K and V, in every KV cache


FORK_SEPARATOR = "/"  # between a forked request's id and the fork's index


def fork_request_id(parent_id: str, index: int) -> str:
    """The id of fork `index` (OpenAI's choice index) of `parent_id`.

    >>> fork_request_id("req-7", 2)
    'req-7/2'
    """
    return f"{parent_id}{FORK_SEPARATOR}{index}"


def fork_seed(seed: int, index: int) -> int:
    """Fork `index`'s seed: the parent's own for fork 0 (so fork 0 samples what the unforked
    request would), else 63 bits of SHA-256 over (seed, index): reproducible and unrelated to
    any other fork's.

    >>> fork_seed(42, 0)
    42
    >>> fork_seed(42, 1) == fork_seed(42, 1) != fork_seed(42, 2)
    True
    """
    if index == 0:
        return seed
    digest = hashlib.sha256(struct.pack("<2q", seed, index)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def pages_to_fork(request: Request, page_size: int, can_copy: bool) -> int:
    """Fresh pages `fork_request` takes: one copy of the partly computed last page for every
    fork but the first, if there is such a page and it can be copied.

    >>> from disagg.engine.sampling_params import SamplingParams
    >>> parent = Request("r", [1] * 10, SamplingParams(n=3), num_computed_tokens=9)
    >>> pages_to_fork(parent, page_size=4, can_copy=True)  # token 8 starts page 2: 2 copies
    2
    """
    partial = request.num_computed_tokens % page_size != 0
    return request.sampling_params.n - 1 if partial and can_copy else 0


def fork_request(parent: Request, allocator: PageAllocator, page_size: int,
                 copy_page: CopyPage | None) -> list[Request]:
    """Replace `parent` by its `n` forks and return them, in index order.

    Fork i holds the parent's full computed pages (shared: one reference more per fork) and,
    if the computed tokens end inside a page, that page: fork 0 keeps the parent's, every
    other fork a fresh copy of it (`copy_page`). Without `copy_page` the other forks hold only
    the full pages and compute the tail tokens again (under a page of work each). Pages past
    the tail are freed: each fork allocates its own as it decodes. The caller makes sure
    `pages_to_fork` pages can be allocated. Fork 0 keeps the parent's generator and seed,
    fork i > 0 gets `fork_seed(seed, i)`; unseeded forks sample from torch's global generator
    like any unseeded request. `parent` ends as `FINISHED_FORKED`, holding no page.
    """
    params = parent.sampling_params
    full, tail = divmod(parent.num_computed_tokens, page_size)
    keep = full + (1 if tail else 0)
    allocator.free(parent.page_ids[keep:])
    shared = parent.page_ids[:full]
    tail_page = parent.page_ids[full] if tail else None
    digests = parent.page_digests[:full]
    forks = []
    for index in range(params.n):
        page_ids, computed = list(shared), parent.num_computed_tokens
        if index > 0:
            allocator.share(shared)
        if tail_page is not None and index == 0:
            page_ids.append(tail_page)
        elif tail_page is not None and copy_page is not None:
            copy = allocator.allocate(1)[0]
            copy_page(tail_page, copy)
            page_ids.append(copy)
        elif tail_page is not None:
            computed = full * page_size  # no copy: the tail is computed again
        seed = None if params.seed is None else fork_seed(params.seed, index)
        forks.append(Request(
            fork_request_id(parent.request_id, index), list(parent.prompt_token_ids),
            replace(params, n=1, seed=seed), parent.eos_token_ids,
            num_computed_tokens=computed, page_ids=page_ids, state=parent.state,
            generator=parent.generator if index == 0 else None,
            kv_attempts=parent.kv_attempts, prefill_context=parent.prefill_context,
            num_cached_tokens=parent.num_cached_tokens, page_digests=list(digests),
            reuse_prefix=parent.reuse_prefix, parent_id=parent.request_id, index=index,
            traceparent=parent.traceparent))
    parent.page_ids, parent.page_digests = [], []
    parent.forks = forks
    parent.state = RequestState.FINISHED_FORKED
    return forks
