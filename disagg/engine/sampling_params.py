"""What a request asks of the token it gets each step: sampling, the logits processors that
shape the distribution first, log probabilities, parallel samples and a grammar (S1, S8).

Only decoders and single-node engines use these (S8: a prefiller never samples). Every value
is checked here, once, so that no combination a request can carry reaches the sampler as
something it cannot take (X5a). The definitions follow the references users know: OpenAI's
`presence_penalty`, `frequency_penalty` and `logit_bias`; transformers' `repetition_penalty`
(CTRL's); vLLM's `min_tokens` and `stop_token_ids`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disagg.errors import GuideError, RequestError

if TYPE_CHECKING:
    from disagg.engine.guide_spec import Guide

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (as vLLM's do)
MAX_N = 16  # parallel samples of one prompt
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
# A grammar is compiled on the decoder's engine thread at admission: a 48 KiB schema takes
# about 50 ms there, so longer specs are refused rather than stall every running request.
MAX_GUIDE_CHARS = 32 * 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. `temperature == 0` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0  # EOS and stop token ids are masked until this many were generated
    presence_penalty: float = 0.0  # minus this once for each token already generated
    frequency_penalty: float = 0.0  # minus this times the count of each token generated
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of prompt and output ids
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k's
    n: int = 1  # parallel samples: one prefill, n decode streams forked from its pages
    guide: Guide | None = None  # structured output: the grammar every token must follow

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be positive, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            # Logits divided by so small a temperature overflow to inf: it is greedy anyway.
            object.__setattr__(self, "temperature", 0.0)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                               f"{self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise RequestError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 1e4):
            raise RequestError("repetition_penalty must be in (0, 10000], got "
                               f"{self.repetition_penalty}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise RequestError(f"logit_bias: token {token_id} with bias {bias}: ids must be "
                                   ">= 0 and biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.guide is not None and len(self.guide.spec) > MAX_GUIDE_CHARS:
            raise GuideError(f"the structured-output spec has {len(self.guide.spec)} "
                             f"characters; at most {MAX_GUIDE_CHARS} are compiled")

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before temperature, top-k and top-p."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias
                    or self.guide is not None)
