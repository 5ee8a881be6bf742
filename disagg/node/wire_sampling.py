"""A request's sampling parameters and its tokens' log probabilities, to and from the flat
fields of the control messages (`Submit`, `RequestEvent`; S2a, S8).

The wire carries numbers and strings only, so that a message is checked field by field
(`framing.py`); here they become the engine's types and back. `SamplingParams` then checks
every range, so a router's wrong value is a `RequestError` naming it, never a sampler crash.
"""

from __future__ import annotations

from typing import Any

from disagg.control.messages import Submit
from disagg.engine.guide_spec import Guide, GuideKind
from disagg.engine.logprobs import TokenLogprob
from disagg.engine.request import SamplingParams
from disagg.errors import RequestError


def sampling_params(message: Submit) -> SamplingParams:
    """What a router's `Submit` asks for; `RequestError` for values no sampler can take."""
    if len(message.logit_bias_ids) != len(message.logit_bias_values):
        raise RequestError(f"logit_bias: {len(message.logit_bias_ids)} ids but "
                           f"{len(message.logit_bias_values)} biases")
    return SamplingParams(
        max_tokens=message.max_tokens, temperature=message.temperature, top_p=message.top_p,
        top_k=message.top_k, seed=None if message.seed < 0 else message.seed,
        ignore_eos=message.ignore_eos, stop_token_ids=tuple(message.stop_token_ids),
        min_tokens=message.min_tokens, presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty,
        logit_bias=tuple(zip(message.logit_bias_ids, message.logit_bias_values, strict=True)),
        logprobs=None if message.logprobs < 0 else message.logprobs, n=message.n,
        guide=guide_of(message.guide_kind, message.guide_spec, message.guide_strict))


def guide_of(kind: str, spec: str, strict: bool = True) -> Guide | None:
    """The `Guide` a `Submit` names ("" for none)."""
    if not kind:
        return None
    try:
        return Guide(GuideKind(kind), spec, strict)
    except ValueError:
        raise RequestError(f"guide_kind {kind!r} is not one of "
                           f"{[k.value for k in GuideKind]}") from None


def submit_fields(params: SamplingParams) -> dict[str, Any]:
    """The `Submit` fields of `params` beyond the prompt and the request id."""
    guide = params.guide
    return {"max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k,
            "seed": -1 if params.seed is None else params.seed,
            "ignore_eos": params.ignore_eos, "stop_token_ids": list(params.stop_token_ids),
            "min_tokens": params.min_tokens, "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty,
            "logit_bias_ids": [t for t, _ in params.logit_bias],
            "logit_bias_values": [b for _, b in params.logit_bias],
            "logprobs": -1 if params.logprobs is None else params.logprobs, "n": params.n,
            "guide_kind": "" if guide is None else guide.kind.value,
            "guide_spec": "" if guide is None else guide.spec,
            "guide_strict": True if guide is None else guide.strict}


def logprob_fields(logprob: TokenLogprob | None) -> dict[str, Any]:
    """The `RequestEvent` fields of one token's log probabilities (none when not asked)."""
    if logprob is None:
        return {}
    return {"logprobs": [logprob.logprob], "top_logprob_ids": [t for t, _ in logprob.top],
            "top_logprobs": [v for _, v in logprob.top]}


def event_logprobs(token_ids: list[int], logprobs: list[float], top_ids: list[int],
                   top_logprobs: list[float]) -> list[TokenLogprob]:
    """A `RequestEvent`'s log probabilities, one `TokenLogprob` per token (empty if none)."""
    if not logprobs:
        return []
    if len(logprobs) != len(token_ids) or len(top_ids) != len(top_logprobs) or (
            len(top_ids) % len(token_ids)):
        raise RequestError(f"an event's logprobs do not match its {len(token_ids)} tokens")
    k = len(top_ids) // len(token_ids)
    return [TokenLogprob(token, value, tuple(zip(top_ids[i * k:(i + 1) * k],
                                                top_logprobs[i * k:(i + 1) * k], strict=True)))
            for i, (token, value) in enumerate(zip(token_ids, logprobs, strict=True))]
