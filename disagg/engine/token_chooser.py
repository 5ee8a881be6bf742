"""Each request's next token: its logits shaped, masked by its grammar, sampled, and its log
probability kept (S1, S8).

The engine (and a speculator verifying drafts) asks a `TokenChooser` for every token it
appends. The chooser holds what a request's choice depends on beyond its tokens: the position
in its grammar (`guided.GuideState`) and the log probabilities reported so far. Only decoders
and single-node engines have one that is ever asked (S8: a prefiller never samples), so
structured output, penalties and logprobs live on the decoder alone and a prefiller is the same
whatever a request asks. Drafts are verified under the same rules (S8): row j of a speculative
chunk is shaped as if the first j drafts had been accepted, grammar included, and a draft the
grammar forbids has probability 0, so it is never accepted.

A grammar not compiled yet compiles on the chooser's own thread while the request's KV
arrives (or, on a single node, while it prefills), so the engine thread never waits on a
compile at admission; the request's first sampled token waits for it if it must. A grammar
that fails there fails its request alone (X5a); the front door has compiled it before (a 400).
"""

from __future__ import annotations

import dataclasses
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from disagg.engine.logits_processors import process_logits
from disagg.engine.logprobs import TokenLogprob, token_logprob
from disagg.engine.request import Request
from disagg.engine.sampling import sample_token
from disagg.errors import GuideError, RequestError

if TYPE_CHECKING:
    from disagg.engine.guide_spec import Guide
    from disagg.engine.guided import GuideCompiler, GuideState


@dataclass
class Choices:
    """What one request's choices so far left behind."""

    guide: GuideState | None = None
    compiling: Future[GuideState] | None = None  # the grammar, until it is ready
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token


class TokenChooser:
    """Chooses tokens for the requests of one engine; `guides` compiles grammars (None: the
    node has no tokenizer, so it refuses structured output)."""

    def __init__(self, vocab_size: int, guides: GuideCompiler | None = None) -> None:
        self.vocab_size = vocab_size
        self.guides = guides
        self._choices: weakref.WeakKeyDictionary[Request, Choices] = (
            weakref.WeakKeyDictionary())
        self._compiler: ThreadPoolExecutor | None = None  # started by the first compile

    def admit(self, request: Request) -> None:
        """Check what `request` asks against this node and start its grammar; a
        `RequestError` (a `GuideError` for a grammar) names what cannot be served."""
        params = request.sampling_params
        for token_id, _ in params.logit_bias:
            if token_id >= self.vocab_size:
                raise RequestError(f"logit_bias: token {token_id} is outside the vocabulary "
                                   f"of {self.vocab_size}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids: token {bad[0]} is outside the vocabulary of "
                               f"{self.vocab_size}")
        choices = Choices()
        if params.guide is not None:
            if self.guides is None:
                raise RequestError("structured output needs the model's tokenizer, and this "
                                   "node has none")
            if params.ignore_eos:  # a grammar ends with EOS: ignoring it cannot be followed
                raise RequestError("ignore_eos cannot be combined with structured output")
            if self.guides.is_compiled(params.guide):
                choices.guide = self._start(params.guide)
            else:
                if self._compiler is None:
                    self._compiler = ThreadPoolExecutor(1, "grammar-compile")
                choices.compiling = self._compiler.submit(self._start, params.guide)
        self._choices[request] = choices

    def choose(self, request: Request, logits: torch.Tensor) -> int:
        """The next token from ``[vocab_size]`` logits, recorded (see `record`)."""
        token_id = sample_token(self.shape(request, logits), request.sampling_params,
                                request.generator)
        self.record(request, logits, token_id)
        return token_id

    def shape(self, request: Request, logits: torch.Tensor,
              drafted: Sequence[int] = ()) -> torch.Tensor:
        """``[vocab_size]`` logits as the sampler must see them, after the output so far and
        `drafted` (drafts the grammar has tentatively accepted: `shape_rows`)."""
        params = request.sampling_params
        if not params.processes_logits:
            return logits
        output_ids = [*request.output_token_ids, *drafted]
        shaped = process_logits(logits, params, request.prompt_token_ids, output_ids,
                                request.eos_token_ids)
        guide = self._guide(request)
        if guide is None:
            return shaped
        masked = guide.mask_logits(shaped)
        if params.min_tokens and not torch.isfinite(masked).any():
            # The grammar can only end here and min_tokens forbids ending: the grammar wins.
            masked = guide.mask_logits(process_logits(
                logits, dataclasses.replace(params, min_tokens=0), request.prompt_token_ids,
                output_ids, request.eos_token_ids))
        return masked

    def shape_rows(self, request: Request, rows: torch.Tensor,
                   drafts: Sequence[int]) -> torch.Tensor:
        """A speculative chunk's ``[k + 1, vocab_size]`` logits shaped row by row: row j as if
        drafts[:j] were accepted. Past a draft the grammar forbids, rows repeat the last
        (verification stops there: that draft has probability 0)."""
        if not request.sampling_params.processes_logits:
            return rows
        guide = self._guide(request)
        shaped: list[torch.Tensor] = []
        advanced = 0  # drafts the grammar accepted so far, rolled back at the end
        try:
            for j in range(len(rows)):
                if advanced < j:  # draft j - 1 is forbidden: verification stops there
                    shaped.append(shaped[-1])
                    continue
                shaped.append(self.shape(request, rows[j], drafts[:j]))
                if j == len(drafts) or not bool(torch.isfinite(shaped[-1][drafts[j]])):
                    continue
                if guide is not None:
                    guide.accept(drafts[j])
                advanced += 1
        finally:
            if guide is not None and advanced:
                guide.rollback(advanced)
        return torch.stack(shaped)

    def record(self, request: Request, logits: torch.Tensor, token_id: int) -> None:
        """`token_id` was chosen from ``[vocab_size]`` raw `logits`: advance the grammar and
        keep its log probability if the request asks for them."""
        choices = self._get(request)
        guide = self._guide(request)
        if guide is not None:
            guide.accept(token_id)
        k = request.sampling_params.logprobs
        if k is not None:
            choices.logprobs.append(token_logprob(logits, token_id, k))

    def logprobs(self, request: Request) -> list[TokenLogprob]:
        """One per output token, for a request that asks for them (else empty)."""
        return self._get(request).logprobs

    def _start(self, guide: Guide) -> GuideState:
        assert self.guides is not None
        try:
            return self.guides.start(guide)
        except RequestError:
            raise
        except Exception as error:  # a spec no check foresaw must not stop the node (X5a)
            raise GuideError(f"{guide.kind.value}: {type(error).__name__}: "
                             f"{error}"[:300]) from None

    def _guide(self, request: Request) -> GuideState | None:
        """The request's grammar, once compiled (a GuideError if it could not be)."""
        choices = self._get(request)
        if choices.compiling is not None:
            choices.guide = choices.compiling.result()  # a failed compile raises each time
            choices.compiling = None
        return choices.guide

    def _get(self, request: Request) -> Choices:
        choices = self._choices.get(request)
        if choices is None:  # admitted without `admit`: one that asks for nothing special
            if request.sampling_params.guide is not None:
                raise RequestError(f"request {request.request_id}: its grammar was never started")
            choices = self._choices[request] = Choices()
        return choices

