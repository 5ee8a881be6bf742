"""A request as the scheduler and the messengers see it (S2a); what it asks of each token is
`sampling_params.py`.

The one counter that matters is `num_computed_tokens`: tokens whose K/V are in this node's cache,
whether computed here or written by a prefiller over RDMA. A request needs work whenever it is
below `num_tokens` (prompt plus generated tokens). A request asking for `n > 1` samples is
replaced, once its prompt is computed but for the last token, by `n` forks with ids
`f"{parent_id}/{index}"` (`forking.py`); the parent then lists them in `forks`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from disagg.engine.sampling_params import SamplingParams
from disagg.errors import RequestError

__all__ = ["FailureCause", "Request", "RequestState", "SamplingParams", "TERMINAL_STATES"]


class RequestState(enum.Enum):
    """Where a request is in its life. The one vocabulary of the whole system: the scheduler,
    the messengers, the quarantine, the wire (`RequestEvent.state`) and the router use it."""

    WAITING = "waiting"  # queued, no pages yet (or preempted)
    WAITING_FOR_KV = "waiting_for_kv"  # pages pinned, KV arriving from a prefiller (S2a)
    RUNNING = "running"  # scheduled: prefilling or decoding
    TRANSFERRING = "transferring"  # prefiller: prompt computed, KV writes still in flight (S4b)
    FINISHED_STOPPED = "finished_stopped"  # hit an EOS or stop token
    FINISHED_LENGTH = "finished_length"  # hit max_tokens
    FINISHED_ABORTED = "finished_aborted"  # the client gave up
    FINISHED_TRANSFERRED = "finished_transferred"  # prefiller: every write landed, pages freed
    FINISHED_FAILED = "finished_failed"  # a peer or transfer failed; `FailureCause` says which
    FINISHED_FORKED = "finished_forked"  # n > 1: its forks decode instead (`forking.py`)

    def is_terminal(self) -> bool:
        """Whether nothing more happens to a request in this state."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({
    RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH, RequestState.FINISHED_ABORTED,
    RequestState.FINISHED_TRANSFERRED, RequestState.FINISHED_FAILED,
    RequestState.FINISHED_FORKED})


class FailureCause(enum.Enum):
    """Why a request failed, was retried or was aborted: carried in messages and metrics,
    never recovered from error text."""

    DEADLINE = "deadline"  # its KV did not arrive in time
    CHECKSUM = "checksum"  # the KV that arrived does not match the prefiller's checksum
    PREFILLER_DIED = "prefiller_died"  # the prefiller went away with the request in flight
    NO_PREFILLER = "no_prefiller"  # no live prefiller to ask
    PREFILLER_REFUSED = "prefiller_refused"  # the prefiller refused the request
    WRITE_FAILED = "write_failed"  # an RDMA write failed at the prefiller
    LEASE_EXPIRED = "lease_expired"  # the prefiller stopped a transfer older than its lease
    CANCELLED = "cancelled"  # the decoder cancelled the transfer (deadline or abort)
    DECODER_GONE = "decoder_gone"  # prefiller: the decoder went away
    DECODER_DIED = "decoder_died"  # router: the decoder holding the request died
    INVALID_REQUEST = "invalid_request"  # refused at admission (it can never be served)
    ABORTED = "aborted"  # the client gave up
    ENGINE_ERROR = "engine_error"  # stepping it raised; it failed alone (X5a, `isolation.py`)


@dataclass(eq=False)
class Request:
    """One prompt being served."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    generator: torch.Generator | None = None
    kv_attempts: int = 1  # decoder: times the KV was asked for (a retry after a failure adds one)
    # Speculative decoding (S8): drafts awaiting verification (they follow the real tokens
    # in the next forward), the shipped hidden state of the last prefilled position
    # (S4a), and how many drafts were verified and accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    prefill_context: torch.Tensor | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prefix caching: prompt tokens whose KV was found in this node's cache at admission, the
    # chained digests of the request's first full pages (registered or found, in order), and
    # whether admission may take cached pages at all (an MTP draft head must see every token).
    num_cached_tokens: int = 0
    page_digests: list[bytes] = field(default_factory=list)
    reuse_prefix: bool = True
    # Parallel samples (`forking.py`): a fork's parent and choice index; a parent's forks.
    parent_id: str | None = None
    index: int = 0
    forks: list[Request] = field(default_factory=list)
    # The W3C context of this node's span of the request (X7a): messages about it carry it.
    traceparent: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise RequestError(f"request {self.request_id}: the prompt is empty")
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens `start` to `end` (not included) of the prompt, then the generated tokens,
        then the drafts (S8), without joining the lists: `all_token_ids` copies the whole
        context, which a step that needs one token per request should not."""
        taken: list[int] = []
        for part in (self.prompt_token_ids, self.output_token_ids, self.spec_token_ids):
            if start < len(part) and end > 0:
                taken += part[max(start, 0):end]
            start, end = start - len(part), end - len(part)
        return taken

    @property
    def last_token_id(self) -> int:
        """The latest token: the last generated one, else the prompt's last."""
        return (self.output_token_ids or self.prompt_token_ids)[-1]

    @property
    def is_finished(self) -> bool:
        """Whether the request reached a terminal state."""
        return self.state.is_terminal()

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and finish the request if it stops here."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        stops = not params.ignore_eos and token_id in self.eos_token_ids
        if stops or token_id in params.stop_token_ids:
            self.state = RequestState.FINISHED_STOPPED
        elif len(self.output_token_ids) >= params.max_tokens:
            self.state = RequestState.FINISHED_LENGTH
