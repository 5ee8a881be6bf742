"""Speculative decoding on an `LLMEngine`: verify drafts in one target forward, accept, roll
back, draft again (S8).

NOTE on the step. Drafts are proposed at the end of a step, for every request whose prompt is
computed, and stored in `request.spec_token_ids`; the scheduler then gives the request a chunk
of 1 + k tokens (its last real token and the drafts) and reserves their pages like any
prefill chunk. After the target's forward, the k + 1 rows' logits verify the drafts
(`verify.verify`), `Scheduler.accept_tokens` appends the accepted ones plus one token from
the target, moves `num_computed_tokens` back over the rejected ones and frees pages past the
next position. So between steps a request holds no page beyond those its next forward writes,
and the page allocator's invariants hold after every step. Greedy output is token for token the
non-speculative engine's; sampled output has the same distribution. The first decode step of a
request prefilled elsewhere is an ordinary one (S8); it and the shipped hidden state (S4a) are
what the MTP head starts from.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from disagg.config import EngineConfig, SpeculativeConfig
from disagg.engine.batch import Batch, ForwardOutput, TokenEvent
from disagg.engine.llm_engine import EngineParts, LLMEngine, load_transformer
from disagg.engine.request import Request, RequestState
from disagg.model.draft_heads import build_mtp_head, mtp_kv_cache
from disagg.model.kv_cache import PagedKVCache
from disagg.speculative.proposers import EarlyExitProposer, MTPProposer
from disagg.speculative.verify import propose_token, verify, verify_greedy_lazily


@dataclass
class SpecStats:
    """Totals over every speculative chunk verified so far."""

    verify_steps: int = 0  # speculative chunks (one target forward each, per request)
    drafted: int = 0  # drafts verified
    accepted: int = 0  # ... of which the target agreed with

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over verified drafts."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a speculative chunk yields on average (1 without any acceptance)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class Speculator:
    """Observes an `LLMEngine`'s steps and takes over their sampling and postprocessing (see
    `speculative_engine`)."""

    def __init__(self, parts: EngineParts, config: SpeculativeConfig) -> None:
        self._parts = parts
        self.config = config
        model, device = parts.model, parts.config.device
        self.kv_cache: PagedKVCache | None = None  # the draft's own pages, if it has any
        if config.kind == "mtp":
            head = build_mtp_head(model.config, dtype=parts.config.dtype).to(device)
            self.kv_cache = mtp_kv_cache(model.config, parts.config.cache, device)
            self.proposer: EarlyExitProposer | MTPProposer = MTPProposer(model, head,
                                                                         self.kv_cache)
        else:
            self.proposer = EarlyExitProposer(model, parts.kv_cache,
                                              config.exit_layer(model.config))
        self.stats = SpecStats()
        # The distribution each pending draft came from (sampling only), per request.
        self._draft_probs: weakref.WeakKeyDictionary[Request, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary())
        # A verified chunk's logits, until its accepted tokens are recorded (`_record`).
        self._verified_rows: weakref.WeakKeyDictionary[Request, torch.Tensor] = (
            weakref.WeakKeyDictionary())
        # Forks of an n > 1 request (X6c) copy the head's pages and start where it stood.
        parts.forks.add(copy_page=None if self.kv_cache is None else self.kv_cache.copy_page,
                        on_fork=self._on_fork)

    def on_batch(self, batch: Batch) -> None:
        """Before the forward: drop drafts the scheduler did not fit (token budget, chunk size,
        preemption), so `spec_token_ids` is exactly what this forward verifies."""
        scheduled = {id(chunk.request): chunk for chunk in batch.chunks}
        scheduler = self._parts.scheduler
        for request in [*scheduler.running, *scheduler.waiting]:
            if request.spec_token_ids:
                chunk = scheduled.get(id(request))
                keep = max(0, chunk.end - request.num_tokens) if chunk is not None else 0
                del request.spec_token_ids[keep:]

    def after_forward(self, batch: Batch, output: ForwardOutput) -> None:
        """Nothing between the forward and `finish_step`: verifying happens there."""

    @torch.inference_mode()
    def finish_step(self, batch: Batch, output: ForwardOutput) -> list[TokenEvent]:
        """After the forward: sample ordinary chunks, verify speculative ones, advance every
        request, run the draft on what was confirmed and propose the next drafts. Each
        request's share runs guarded, so one that raises fails alone (X5a)."""
        parts, hidden = self._parts, output.all_hidden_states
        assert hidden is not None, "the runner returns every row's hidden state"
        isolation, chooser = parts.isolation, parts.chooser
        sampled = {}
        for row, chunk_idx in enumerate(output.sample_chunk_indices):
            request = batch.chunks[chunk_idx].request
            with isolation.guard(request, "sampling"):
                sampled[request.request_id] = chooser.choose(request, output.logits[row])
        verified: list[tuple[Request, list[int]]] = []
        end = 0
        for chunk in batch.chunks:
            end += chunk.num_tokens
            if chunk.request.spec_token_ids and not chunk.request.is_finished:
                with isolation.guard(chunk.request, "verifying its drafts"):
                    verified.append((chunk.request, self._verify(chunk.request, hidden, end)))
        before = [len(chunk.request.output_token_ids) for chunk in batch.chunks]
        for chunk in batch.chunks:
            if not chunk.request.is_finished:  # else it failed above
                with isolation.guard(chunk.request, "appending its token"):
                    parts.scheduler.advance(chunk, sampled.get(chunk.request.request_id))
        for request, token_ids in verified:
            if not request.is_finished:
                with isolation.guard(request, "accepting its drafts"):
                    count = len(request.output_token_ids)
                    parts.scheduler.accept_tokens(request, token_ids)
                    self._record(request, request.output_token_ids[count:])
        try:
            self.proposer.observe(batch, hidden)
        except Exception as error:  # a batched draft forward: not one request's (X5a)
            isolation.fail([chunk.request for chunk in batch.chunks], "the draft's catch-up",
                           error)
        self._propose()
        events = []
        for chunk, count in zip(batch.chunks, before, strict=True):
            request = chunk.request
            if request.state is RequestState.FINISHED_FAILED:
                continue  # failed this step: reported through `take_failures`
            new = request.output_token_ids[count:]
            logprobs = chooser.logprobs(request)[count:] or [None] * len(new)
            events += [TokenEvent(request, token_id, request.is_finished and i == len(new) - 1,
                                  logprob)
                       for i, (token_id, logprob) in enumerate(zip(new, logprobs, strict=True))]
        return events

    def _verify(self, request: Request, hidden: torch.Tensor, end: int) -> list[int]:
        """Tokens to append for a speculative chunk whose rows end at `end`."""
        drafts = list(request.spec_token_ids)
        rows = hidden[end - len(drafts) - 1:end]  # the last real token's row, then the drafts'
        model, params, chooser = self._parts.model, request.sampling_params, self._parts.chooser
        probs = self._draft_probs.pop(request, None)
        # The chooser needs every row's logits when it shapes them or keeps their logprobs.
        needs_rows = params.processes_logits or params.logprobs is not None
        if params.temperature == 0.0 and not needs_rows:
            token_ids = verify_greedy_lazily(
                drafts, lambda row: int(model.compute_logits(rows[row]).argmax()))
        else:
            # Penalties and a grammar shape row j as if drafts[:j] were accepted (S8).
            logits = model.compute_logits(rows)
            shaped = chooser.shape_rows(request, logits, drafts)
            if params.temperature == 0.0:
                token_ids = verify_greedy_lazily(drafts, lambda row: int(shaped[row].argmax()))
            else:
                assert probs is not None, "sampled drafts keep the distribution they came from"
                token_ids = verify(drafts, torch.stack(probs[:len(drafts)]), shaped, params,
                                   request.generator)
            if needs_rows:  # recorded once accepted (a stop may cut them short): `_record`
                self._verified_rows[request] = logits
        self.stats.verify_steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += len(token_ids) - 1
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += len(token_ids) - 1
        return token_ids

    def _on_fork(self, parent: Request, forks: list[Request]) -> None:
        """Each fork's MTP head stands where the parent's stood (its pages were copied)."""
        if isinstance(self.proposer, MTPProposer) and parent in self.proposer.states:
            for fork in forks:
                self.proposer.states[fork] = dataclasses.replace(self.proposer.states[parent])

    def _record(self, request: Request, token_ids: list[int]) -> None:
        """Tell the chooser which verified tokens were appended, with their rows' logits."""
        logits = self._verified_rows.pop(request, None)
        if logits is not None:
            for row, token_id in enumerate(token_ids):
                self._parts.chooser.record(request, logits[row], token_id)

    def _propose(self) -> None:
        """Draft for every running request whose prompt is computed and that has no drafts.
        A request whose draft choice raises fails alone once the batched proposal is done
        (its pages are not freed while the draft still writes them); a proposal that raises
        as a whole fails every request it drafted for (X5a)."""
        scheduler, isolation = self._parts.scheduler, self._parts.isolation
        requests, num_drafts = [], []
        for request in [r for r in scheduler.running
                        if r.output_token_ids and not r.spec_token_ids
                        and r.num_computed_tokens == r.num_tokens - 1]:
            with isolation.guard(request, "reserving its draft pages"):
                num_drafts.append(self._reserve(request, self._budget(request)))
                requests.append(request)
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        errors: dict[int, Exception] = {}

        def choose(i: int, logits: torch.Tensor) -> int:
            request = requests[i]
            try:
                token, q = propose_token(logits, request.sampling_params, request.generator)
            except Exception as error:
                errors.setdefault(i, error)  # failed below, after the batched run
                return int(logits.argmax())  # any valid id keeps the batch going
            if request.sampling_params.temperature > 0:
                probs[i].append(q)
            return token

        try:
            drafts = self.proposer.propose(requests, num_drafts, choose)
        except Exception as error:
            isolation.fail(requests, "the draft's proposal", error)
            return
        for i, error in errors.items():
            isolation.fail([requests[i]], "choosing its draft", error)
        for request, tokens, q in zip(requests, drafts, probs, strict=True):
            if request.is_finished:
                continue
            request.spec_token_ids = tokens
            if q:
                self._draft_probs[request] = q

    def _budget(self, request: Request) -> int:
        """Drafts worth proposing: never more tokens than the request may still produce (a
        chunk yields drafts + 1), nor positions past the model's context."""
        remaining = request.sampling_params.max_tokens - len(request.output_token_ids) - 1
        room = self._parts.scheduler.max_model_len - request.num_tokens
        return max(0, min(self.config.num_draft_tokens, remaining, room))

    def _reserve(self, request: Request, num_drafts: int) -> int:
        """Take the pages of the request's verify chunk (drafts write K/V into them as they
        go); with too few free pages, propose fewer drafts instead of preempting anyone."""
        allocator, page_size = self._parts.allocator, self._parts.kv_cache.page_size
        held = len(request.page_ids) + allocator.num_free
        num_drafts = max(0, min(num_drafts, held * page_size - request.num_tokens))
        if num_drafts == 0:
            return 0  # a plain decode: the scheduler finds its page (or preempts for it)
        needed = -(-(request.num_tokens + num_drafts) // page_size) - len(request.page_ids)
        if needed > 0:
            request.page_ids.extend(allocator.allocate(needed))
        return num_drafts


def speculative_engine(parts: EngineParts, config: SpeculativeConfig) -> LLMEngine:
    """An engine (a decoder or a single node, never a prefiller) that speculates with `config`:
    its speculator observes every step and finishes it."""
    speculator = Speculator(parts, config)
    return LLMEngine(parts, observers=[speculator], finisher=speculator)


def build_speculative_engine(config: EngineConfig, state_dict: dict[str, torch.Tensor],
                             spec: SpeculativeConfig) -> LLMEngine:
    """Like `build_engine`, speculating with `spec`."""
    return speculative_engine(EngineParts.build(config, load_transformer(config, state_dict)),
                              spec)
