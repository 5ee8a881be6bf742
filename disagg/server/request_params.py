"""A validated request body turned into what the decoder is asked for: `SamplingParams`, with
the token budget fitted to the context and the decoder's cache (S8, X5b).

Every check that needs no model runs here, before submission, so a bad value is a 400 naming
its field: a budget that cannot fit, a token id outside the vocabulary, a grammar the library
cannot compile (when the front door has the tokenizer to compile it with). The decoder checks
the same things again: a router may be someone else's.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.guide_spec import Guide
from disagg.engine.request import SamplingParams
from disagg.errors import GuideError, RequestError
from disagg.server.errors import InvalidRequest
from disagg.server.protocol import SamplingFields


@dataclass(frozen=True, slots=True)
class Budget:
    """How many tokens a request may hold: the model's context and, when known, a decoder's
    whole cache."""

    context: int
    cache: int | None = None

    def max_tokens(self, prompt_len: int, asked: int | None, param: str, n: int = 1) -> int:
        """`asked` checked against the room the prompt leaves, or as many as fit. The `n`
        choices share the prompt's pages and each needs its own for its tokens (X6c)."""
        room = self.context - prompt_len
        if room < 1:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; the model's context is "
                                 f"{self.context}", "prompt")
        if asked is not None and asked > room:
            raise InvalidRequest(f"{param}={asked} does not fit: the prompt has {prompt_len} "
                                 f"tokens and the context is {self.context}", param)
        cache = self.cache
        if asked is None:  # as many as fit: the context, and the cache when known
            return room if cache is None else max(1, min(room, (cache - prompt_len) // n))
        if cache is not None and prompt_len + n * asked > cache:
            choices = f" for each of n={n} choices" if n > 1 else ""
            raise InvalidRequest(f"{prompt_len} prompt tokens + {param}={asked}{choices} do not "
                                 f"fit a decoder's KV cache of {cache} tokens", param)
        return asked


def sampling_params(body: SamplingFields, max_tokens: int, vocab_size: int,
                    logprobs: int | None = None, guide: Guide | None = None) -> SamplingParams:
    """`body`'s sampling fields as `SamplingParams` (`guide`: the grammar the body asks for,
    or one the caller imposes, such as a required tool call's)."""
    bias = body.logit_bias_pairs()
    for token_id, _ in bias:
        if token_id >= vocab_size:
            raise InvalidRequest(f"logit_bias: token {token_id} is outside the vocabulary of "
                                 f"{vocab_size}", "logit_bias")
    stop_ids = tuple(body.stop_token_ids or ())
    if any(t >= vocab_size for t in stop_ids):
        raise InvalidRequest(f"stop_token_ids: an id is outside the vocabulary of {vocab_size}",
                             "stop_token_ids")
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens={min_tokens} is more than the {max_tokens} tokens "
                             "the request may generate", "min_tokens")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None
            else body.temperature, top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k, 0), seed=body.seed, ignore_eos=body.ignore_eos,
            stop_token_ids=stop_ids, min_tokens=min_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0, logit_bias=bias,
            logprobs=logprobs, n=body.n or 1, guide=guide)
    except GuideError as error:
        raise InvalidRequest(str(error), guide_param(body) or "tools") from None
    except RequestError as error:  # the body's types let through what the engine refuses
        raise InvalidRequest(str(error)) from None


def guide_param(body: SamplingFields) -> str | None:
    """The field that asked for the body's grammar, for an error naming it."""
    return next((name for name, guide in body.guides().items() if guide is not None), None)
