"""Running a draft for k steps: the early-exit and MTP proposers, and the MTP catch-up (S8).

NOTE on draft KV and rollback. Target K/V at positions below `num_computed_tokens` are the
target's own; anything at or past it is scratch that the next forward overwrites before it
reads it (every forward appends before it attends). The early-exit draft runs the target's
first layers on the same tokens at the same positions, so for confirmed positions its K/V *are*
the target's: it reuses the target cache for its layers and only ever writes scratch positions
(the last real token and its own drafts). Rejecting drafts is then only `num_computed_tokens`
moving back. The MTP head keeps its own one-layer cache (same page ids, separate buffer) whose
positions below `MTPState.done` were computed from the target's hidden states; its draft-chain
writes sit at `done` and past it, and the next catch-up, fed by the verify forward's hidden
states, overwrites them. Neither draft needs a page the verify chunk would not need.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.engine.batch import Batch
from disagg.engine.request import Request
from disagg.model.draft_heads import MTPHead, Span, span_metadata
from disagg.model.kv_cache import KVCache
from disagg.model.transformer import Transformer

# (index of the request in the proposer's list, draft logits [vocab_size]) -> the draft token.
Choose = Callable[[int, torch.Tensor], int]


@dataclass
class CatchUp:
    """MTP rows to run for one request: positions `[start, start + len(hidden))`."""

    page_ids: list[int]
    start: int
    hidden: torch.Tensor  # [n, hidden_size]: the target's hidden state at each position
    next_token_ids: list[int]  # [n]: the token after each position


@torch.inference_mode()
def mtp_catch_up(head: MTPHead, target: Transformer, kv_cache: KVCache, items: list[CatchUp]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the MTP head over every item's rows (writing its cache); returns, for each item's
    last row, the block output ``[num_items, hidden_size]`` and logits ``[num_items, vocab]``."""
    spans = [Span(item.page_ids, item.start, len(item.next_token_ids)) for item in items]
    positions, meta = span_metadata(spans, kv_cache.page_size, kv_cache.device)
    # The shipped hidden state is float32 (the context slot's dtype): the head's, here.
    hidden = torch.cat([item.hidden for item in items]).to(kv_cache.device,
                                                           head.eh_proj.weight.dtype)
    next_ids = torch.tensor([t for item in items for t in item.next_token_ids],
                            dtype=torch.int64, device=kv_cache.device)
    out, normed = head(target, hidden, next_ids, positions, kv_cache, meta)
    last = torch.tensor([s.query_start + s.query_len - 1 for s in meta.sequences],
                        device=kv_cache.device)
    return out[last], target.compute_logits(normed[last])


class EarlyExitProposer:
    """Drafts with the target's first `num_layers` layers, reusing the target's cache."""

    def __init__(self, target: Transformer, kv_cache: KVCache, num_layers: int) -> None:
        self.target = target
        self.kv_cache = kv_cache
        self.num_layers = num_layers

    def observe(self, batch: Batch, hidden: torch.Tensor) -> None:
        """Nothing to catch up: the target's forward already wrote the draft's layers."""

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int], choose: Choose
                ) -> list[list[int]]:
        """Up to `num_drafts[i]` tokens after each request's last token (whose K/V is not
        computed yet: the first step runs it, at position `num_tokens - 1`)."""
        drafts: list[list[int]] = [[] for _ in requests]
        last = [r.last_token_id for r in requests]
        for step in range(max(num_drafts, default=0)):
            active = [i for i, k in enumerate(num_drafts) if k > step]
            spans = [Span(requests[i].page_ids, requests[i].num_tokens - 1 + step, 1)
                     for i in active]
            positions, meta = span_metadata(spans, self.kv_cache.page_size, self.kv_cache.device)
            ids = torch.tensor([last[i] for i in active], device=self.kv_cache.device)
            hidden = self.target(ids, positions, self.kv_cache, meta, num_layers=self.num_layers)
            logits = self.target.compute_logits(hidden)
            for row, i in enumerate(active):
                last[i] = choose(i, logits[row])
                drafts[i].append(last[i])
        return drafts


@dataclass
class MTPState:
    """Where one request's MTP cache stands."""

    done: int  # MTP K/V of positions [0, done) come from the target's hidden states
    carry: tuple[int, torch.Tensor] | None = None  # (position, hidden) shipped, not yet run
    hidden: torch.Tensor | None = None  # block output at done - 1: the next chain's input
    logits: torch.Tensor | None = None  # logits at done - 1: they predict the first draft


class MTPProposer:
    """Drafts with an `MTPHead`: catch up on confirmed positions, then chain on its own output."""

    def __init__(self, target: Transformer, head: MTPHead, kv_cache: KVCache) -> None:
        self.target = target
        self.head = head
        self.kv_cache = kv_cache
        self.states: weakref.WeakKeyDictionary[Request, MTPState] = weakref.WeakKeyDictionary()

    def _state(self, request: Request) -> MTPState:
        state = self.states.get(request)
        if state is None:
            shipped = request.prefill_context
            if shipped is not None:
                # Prefilled elsewhere (S8): the prefiller ran the head up to the second-to-last
                # prefilled position; the last one runs here, from the shipped hidden state.
                done = request.num_prompt_tokens - 2
                state = MTPState(done, (done, shipped))
            else:
                state = MTPState(0)
            self.states[request] = state
        return state

    def observe(self, batch: Batch, hidden: torch.Tensor) -> None:
        """After the target's forward and the verification: run the head on every newly
        confirmed position of each request, from the target's hidden states ``hidden``
        (``[batch.num_tokens, hidden_size]``, packed as the batch)."""
        items, states, row = [], [], 0
        for chunk in batch.chunks:
            request, rows = chunk.request, hidden[row:row + chunk.num_tokens]
            row += chunk.num_tokens
            if request.is_finished:
                self.states.pop(request, None)
                continue
            state = self._state(request)
            if chunk.start < state.done:  # recomputed from scratch (preempted): so is the head
                state.done, state.carry = chunk.start, None
            end = request.num_computed_tokens
            if end <= state.done:
                continue
            pieces = []
            if state.done < chunk.start:
                # Only the shipped row may precede a chunk: anything else is a lost position.
                carry = state.carry
                assert carry is not None, f"MTP of {request.request_id}: gap at {state.done}"
                assert carry[0] == state.done == chunk.start - 1
                pieces.append(carry[1][None].to(rows.dtype))
                state.carry = None
            pieces.append(rows[max(state.done - chunk.start, 0):end - chunk.start])
            items.append(CatchUp(request.page_ids, state.done, torch.cat(pieces),
                                 request.token_ids(state.done + 1,
                                                   min(end + 1, request.num_tokens))))
            states.append((state, end))
        if not items:
            return
        out, logits = mtp_catch_up(self.head, self.target, self.kv_cache, items)
        for i, (state, end) in enumerate(states):
            state.done, state.hidden, state.logits = end, out[i], logits[i]

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int], choose: Choose
                ) -> list[list[int]]:
        """Up to `num_drafts[i]` tokens per request: the first from the catch-up's logits, the
        rest by feeding the head its own output and the previous draft."""
        drafts: list[list[int]] = [[] for _ in requests]
        carry: dict[int, torch.Tensor] = {}
        num_drafts = list(num_drafts)
        for i, request in enumerate(requests):
            state = self.states.get(request)
            ready = state is not None and state.done == request.num_computed_tokens
            if num_drafts[i] == 0 or not ready or state.logits is None:
                num_drafts[i] = 0  # not caught up (e.g. before its first decode step)
                continue
            drafts[i].append(choose(i, state.logits))
            carry[i] = state.hidden
        for step in range(1, max(num_drafts, default=0)):
            active = [i for i, k in enumerate(num_drafts) if k > step]
            # Draft `step` comes from position num_tokens - 2 + step (the head predicts t+2).
            spans = [Span(requests[i].page_ids, requests[i].num_tokens - 2 + step, 1)
                     for i in active]
            positions, meta = span_metadata(spans, self.kv_cache.page_size, self.kv_cache.device)
            ids = torch.tensor([drafts[i][-1] for i in active], device=self.kv_cache.device)
            hidden = torch.stack([carry[i] for i in active])
            out, normed = self.head(self.target, hidden, ids, positions, self.kv_cache, meta)
            logits = self.target.compute_logits(normed)
            for row, i in enumerate(active):
                carry[i] = out[row]
                drafts[i].append(choose(i, logits[row]))
        return drafts
