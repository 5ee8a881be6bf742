"""Continuous batching with chunked prefill under a token budget (S1, S3a, X2a), and forks.

NOTE on the algorithm. There is no "prefill phase" or "decode phase" in the state: each request
only has `num_computed_tokens` (K/V in the cache) and `num_tokens` (prompt plus outputs), and
every step tries to close the gap, at most `chunk_size` tokens per request and
`max_num_batched_tokens` per step. A prompt closes its gap in chunks; a decode's gap is the one
token sampled last step. So a step naturally mixes prefill chunks with decodes (the "mixed" mode
of S1), and the chunk that closes a request's gap is the one whose last row is sampled.
Running requests go first, oldest first, so decodes are not starved by new prompts; when pages
run out the newest unpinned running request is preempted (its pages freed, recomputed later).
A prefiller never preempts: its pages may be read by RDMA writes already posted, so it admits
a request only with every page it will need.
With a prefix cache, a request admitted with no pages first takes the cached pages of its
longest cached prefix and starts computing after them (never its last token: that one must run
to be sampled); full pages are registered as soon as their tokens' KV is computed.
A request asking for `n > 1` samples is prefilled to all but its last prompt token (a decoder's
arrives so, S8), then replaced in place by its `n` forks (`forking.py`), which share its full
pages; it counts as `n` sequences from admission. Forks are ordinary requests from then on.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from disagg.config import SchedulerConfig
from disagg.engine.batch import Batch, ScheduledChunk
from disagg.engine.forking import fork_request, pages_to_fork
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.prefix_pages import PrefixPages
from disagg.engine.request import Request, RequestState
from disagg.errors import RequestError

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which chunk of which request runs."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int,
                 max_model_len: int, copy_page: Callable[[int, int], None] | None = None,
                 on_fork: Callable[[Request, list[Request]], None] | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.max_model_len = max_model_len
        # Copies a page in every KV cache (the model's, a draft head's): a fork's own copy of
        # the partly computed last page. Without it forks compute that page's tokens again.
        self.copy_page = copy_page
        # Told (parent, forks) as forks replace their parent, before any of them samples: what
        # keeps per-request state elsewhere (a grammar, a draft head's) starts theirs.
        self.on_fork = on_fork
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._parents: dict[str, Request] = {}  # forked requests with a fork still live
        self.prefix = PrefixPages(allocator, page_size)  # a no-op without a prefix cache

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse one that could never fit."""
        self.check_fits(request)
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Raise `RequestError` if `request` could never fit the cache or the context."""
        longest = request.num_prompt_tokens + request.sampling_params.max_tokens
        if request.num_prompt_tokens > self.max_model_len:
            raise RequestError(f"request {request.request_id}: prompt of "
                               f"{request.num_prompt_tokens} tokens exceeds the limit of "
                               f"{self.max_model_len} (cache size / model context)")
        n = self._seqs(request)
        if n > self.config.max_num_seqs:
            raise RequestError(f"request {request.request_id}: n={n} samples exceed the "
                               f"{self.config.max_num_seqs} sequences a step may hold")
        # Every fork holds the prompt's full pages (shared) and pages of its own.
        shared = (request.num_prompt_tokens - 1) // self.page_size
        pages = self._pages_for(longest - 1) + (n - 1) * (self._pages_for(longest - 1) - shared)
        if pages > self.allocator.num_pages:
            samples = f" x {n} samples" if n > 1 else ""
            raise RequestError(f"request {request.request_id}: {longest} tokens{samples} need "
                               f"{pages} pages, the cache has {self.allocator.num_pages}")

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """Pick this step's chunks and make sure their pages exist."""
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        self._fork_running()
        # Running requests first; iterate over a copy because preemption edits the list.
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted by a request ahead of it
                continue
            num_tokens = self._chunk_len(request, budget)
            scheduled = {id(chunk.request) for chunk in batch.chunks}
            if num_tokens == 0 or not self._reserve_pages(request, num_tokens, scheduled):
                continue
            batch.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_tokens))
            budget -= num_tokens
        # Then admit waiting requests while budget, sequence slots and pages allow.
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self._num_seqs() + self._seqs(request) > self.config.max_num_seqs:
                break
            hit = self.prefix.take(request)
            if self._ready_to_fork(request):
                self._fork_waiting(request)
                continue
            num_tokens = self._chunk_len(request, budget)
            # A prefiller reserves a request's every page up front: its pages are written out
            # while it is still being prefilled (S3), so it must never be preempted (S4b).
            reserve = (request.num_tokens - request.num_computed_tokens
                       if self.config.mode == "prefill_only" else num_tokens)
            if num_tokens == 0 or not self._reserve_pages(request, reserve, None):
                if hit:  # hold nothing while waiting: the pages may serve someone else
                    self.prefix.release(request)
                break
            self.prefix.record_lookup(request)
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            self.running.append(request)
            batch.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_tokens))
            budget -= num_tokens
        return batch

    def add_prefilled(self, request: Request) -> None:
        """Run a request whose pages already hold `num_computed_tokens` tokens of KV (S2c)."""
        assert request.page_ids and request.num_computed_tokens > 0, "nothing was prefilled"
        request.state = RequestState.RUNNING
        self.prefix.register(request)
        self.running.append(request)

    def postprocess(self, batch: Batch, sampled: dict[str, int]) -> list[Request]:
        """Advance each chunk's request and append sampled tokens (see `advance`).

        Returns the requests that left the running set: finished ones (pages freed) and, in
        prefill-only mode, those whose prompt is now computed (state TRANSFERRING: their pages
        stay allocated until the messenger has written them out, S4b).
        """
        return [chunk.request for chunk in batch.chunks
                if self.advance(chunk, sampled.get(chunk.request.request_id))]

    def advance(self, chunk: ScheduledChunk, token_id: int | None) -> bool:
        """Advance one chunk's request past its computed tokens and append `token_id` if the
        chunk samples; returns whether the request left the running set. One request at a
        time, so the engine can fail one alone if it raises (X5a)."""
        request = chunk.request
        request.num_computed_tokens += chunk.num_tokens
        self.prefix.register(request)
        if chunk.samples and self.config.mode == "prefill_only":
            request.state = RequestState.TRANSFERRING
            self.running.remove(request)
            return True
        if chunk.samples:
            assert token_id is not None, f"{request.request_id}: its chunk samples, no token"
            request.append_token(token_id)
        if request.is_finished:
            self._release(request)
            return True
        return False

    def fail_request(self, request: Request) -> None:
        """End a request that stepping it broke (X5a) wherever it is, freeing its pages."""
        request.state = RequestState.FINISHED_FAILED
        request.spec_token_ids = []
        self._release(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request wherever it is, freeing its pages; returns it, or None if unknown.
        A forked request's id aborts each of its live forks; one fork's id, that fork."""
        parent = self._parents.get(request_id)
        if parent is not None:
            for fork in parent.forks:
                if not fork.is_finished:
                    fork.state = RequestState.FINISHED_ABORTED
                    self._release(fork)
            parent.state = RequestState.FINISHED_ABORTED
            return parent
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    request.state = RequestState.FINISHED_ABORTED
                    self._release(request)
                    return request
        return None

    def accept_tokens(self, request: Request, token_ids: list[int]) -> None:
        """After a speculative chunk (S8): append the verified tokens (up to a stop), roll
        `num_computed_tokens` back over the rejected drafts, whose K/V are now scratch, and free
        the pages only they used. The request then holds the pages up to its next position."""
        request.spec_token_ids = []
        for token_id in token_ids:
            request.append_token(token_id)
            if request.is_finished:
                break
        request.num_computed_tokens = request.num_tokens - 1
        self.prefix.register(request)
        if request.is_finished:
            self._release(request)
            return
        keep = self._pages_for(request.num_tokens)
        if len(request.page_ids) > keep:
            self.allocator.free(request.page_ids[keep:])
            del request.page_ids[keep:]

    def forks_of(self, parent_id: str) -> list[Request]:
        """The forks of a forked request, in choice-index order, while any of them is live;
        [] for a request that was not forked (yet) or whose forks have all finished."""
        parent = self._parents.get(parent_id)
        return list(parent.forks) if parent is not None else []

    def detach(self, request_id: str) -> Request | None:
        """Take a request out of the schedule but leave its pages allocated (a prefiller
        whose writes may still read them frees them later, S4b)."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    return request
        return None

    # Helpers.

    def _chunk_len(self, request: Request, budget: int) -> int:
        # Draft tokens ride along after the real ones: one forward verifies them (S8). A
        # request to fork stops before its last prompt token: each fork runs that one.
        end = (request.num_prompt_tokens - 1 if self._forks_here(request)
               else request.num_tokens + len(request.spec_token_ids))
        return min(end - request.num_computed_tokens, self.config.chunk_size, budget)

    # Forks (`forking.py`).

    def _forks_here(self, request: Request) -> bool:
        """Whether `request` is to be forked here (a prefiller never samples, so never forks)."""
        return request.sampling_params.n > 1 and self.config.mode != "prefill_only"

    def _ready_to_fork(self, request: Request) -> bool:
        return (self._forks_here(request)
                and request.num_computed_tokens == request.num_prompt_tokens - 1)

    def _seqs(self, request: Request) -> int:
        return request.sampling_params.n if self._forks_here(request) else 1

    def _num_seqs(self) -> int:
        return sum(self._seqs(request) for request in self.running)

    def _fork_running(self) -> None:
        """Replace each running request that is ready to fork by its forks, in its place.
        Short of pages for the copies, it preempts newer requests only; else it waits."""
        for request in [r for r in self.running if self._ready_to_fork(r)]:
            if request not in self.running:  # preempted to make room for another's forks
                continue
            needed = pages_to_fork(request, self.page_size, self.copy_page is not None)
            while not self.allocator.can_allocate(needed):
                older = self.running[:self.running.index(request) + 1]
                victim = self._pick_victim({id(r) for r in older})
                if victim is None:
                    break
                self._preempt(victim)
            if self.allocator.can_allocate(needed):
                at = self.running.index(request)
                self.running[at:at + 1] = self._fork(request)

    def _fork_waiting(self, request: Request) -> None:
        """Fork a waiting request that has nothing to prefill but its last token (a 1-token
        prompt, or all else cached): its forks wait in its place, holding no page, and each
        takes the cached pages again when admitted."""
        self.prefix.release(request)
        self.waiting.popleft()
        self.waiting.extendleft(reversed(self._fork(request)))

    def _fork(self, request: Request) -> list[Request]:
        forks = fork_request(request, self.allocator, self.page_size, self.copy_page)
        self._parents[request.request_id] = request
        if self.on_fork is not None:
            self.on_fork(request, forks)
        return forks

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _reserve_pages(self, request: Request, num_tokens: int,
                       scheduled: set[int] | None) -> bool:
        """Grow `request.page_ids` to hold its computed tokens plus `num_tokens` more.

        With `scheduled` (ids of requests already in this step's batch) it may preempt running
        requests outside that set; with None it never preempts (new requests wait instead).
        """
        needed = self._pages_for(request.num_computed_tokens + num_tokens) - len(request.page_ids)
        while needed > 0 and not self.allocator.can_allocate(needed):
            victim = None if scheduled is None else self._pick_victim(scheduled)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is request:
                return False
        if needed > 0:
            request.page_ids.extend(self.allocator.allocate(needed))
        return True

    def _pick_victim(self, scheduled: set[int]) -> Request | None:
        if self.config.mode == "prefill_only":
            return None  # its requests hold all their pages from admission: nothing to take
        for request in reversed(self.running):
            pinned = any(self.allocator.is_pinned(p) for p in request.page_ids)
            if id(request) not in scheduled and not pinned:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        logger.info("preempting %s (out of pages); it will be recomputed", request.request_id)
        self.running.remove(request)
        self.allocator.free(request.page_ids)
        request.page_ids, request.page_digests = [], []
        request.num_computed_tokens = 0
        request.state = RequestState.WAITING
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request.page_ids)
        request.page_ids = []
        parent = self._parents.get(request.parent_id) if request.parent_id else None
        if parent is not None and all(fork.is_finished for fork in parent.forks):
            del self._parents[parent.request_id]
