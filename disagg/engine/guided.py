"""Structured output on the decoder: a token mask per request, from llguidance (S8, X1).

`GuideCompiler` (one per node) checks `Guide`s for the front door's 400 and `start`s one
`GuideState` per request; each step the sampler calls `mask_logits`, then `accept`, and
`rollback` undoes a speculative draft's rejected tokens. Why llguidance over xgrammar 0.2.9
(benchmarks/grammar_libraries.py, SmolLM2's 49,152 ids): xgrammar lets `<|im_start|>`, and in
a maxLength string raw control characters, into JSON strings, and ignores `not`, `uniqueItems`
and `if`/`then` that llguidance refuses (a 400, not a broken promise); cold compile 0.3-0.6 ms
against 18-31 (1-9 with whitespace unbounded); mask fill p50 52 µs against 34, both far under
a 60 ms step; no dependencies (xgrammar pulls triton, ~1 GB, and transformers); import 0.01 s
against 1.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy  # the fill helper without llguidance.torch's torch.compile import
import numpy as np
import torch

from disagg.engine.guide_spec import Guide, GuideKind, grammar_of
from disagg.errors import ConfigError, GuideError
from disagg.model.loading.registry import TokenizedModel
from disagg.model.loading.tokenizer import Tokenizer

__all__ = ["Guide", "GuideCompiler", "GuideKind", "GuideState"]

CACHE_SIZE = 256  # compiled grammars kept per node, least recently used evicted
_MAX_ERROR = 600  # characters of a library error message passed on to the client


class GuideState:
    """One request's position in its grammar. Built by `GuideCompiler.start`.

    Rollback reaches back to the first token (llguidance keeps the whole history).
    """

    def __init__(self, matcher: llguidance.LLMatcher, guide: Guide, vocab_size: int,
                 tokenizer_size: int, eos_token_ids: tuple[int, ...],
                 describe: llguidance.LLTokenizer) -> None:
        self._matcher = matcher
        self._guide = guide
        self._vocab_size = vocab_size
        self._tokenizer_size = tokenizer_size
        self._eos = eos_token_ids
        self._describe = describe
        # llguidance writes a bit for every id it knows: max(vocab_size, tokenizer_size).
        self._bitmask = np.zeros((1, (max(vocab_size, tokenizer_size) + 31) // 32), np.int32)
        self._allowed: torch.Tensor | None = None  # at the current position, until it moves
        self._blocked: torch.Tensor | None = None
        self._num_accepted = 0  # tokens the matcher consumed (a final EOS is ours alone)
        self._eos_accepted = False

    @property
    def is_finished(self) -> bool:
        """An EOS was accepted, or nothing but EOS can follow."""
        return self._eos_accepted or self._matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """bool ``[vocab_size]`` (CPU) of the ids allowed next; EOS ids exactly where the
        grammar may end. Cached until the next accept or rollback: do not modify it."""
        if self._allowed is None:
            self._allowed = self._compute_allowed()
        return self._allowed

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of disallowed ids to -inf, in place, and return `logits`.

        `logits`: ``[vocab_size]`` or ``[1, vocab_size]``, float, on any device.
        """
        if logits.shape[-1] != self._vocab_size or logits.dim() not in (1, 2) \
                or logits.dim() == 2 and logits.shape[0] != 1:
            raise ValueError(f"logits must be [{self._vocab_size}] or [1, {self._vocab_size}], "
                             f"got {list(logits.shape)}")
        if self._blocked is None or self._blocked.device != logits.device:
            self._blocked = (~self.allowed()).to(logits.device)  # one copy per position
        return logits.masked_fill_(self._blocked, float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`; GuideError if the grammar does not allow it here."""
        if self._eos_accepted:
            raise GuideError(f"{self._guide.kind.value}: token {token_id} after the end")
        if token_id in self._eos:
            ok = self._matcher.is_accepting()
        elif not 0 <= token_id < min(self._vocab_size, self._tokenizer_size):
            ok = False
        elif self._allowed is not None:  # the sampler masked first: no need to ask again
            ok = bool(self._allowed[token_id])
        else:
            # A refused consume_token would leave the matcher in an error state for good.
            ok = self._matcher.validate_tokens([token_id]) == 1
        if not ok:
            raise GuideError(f"{self._guide.kind.value}: token {token_id} "
                             f"({self._describe.dbg_tokens([token_id])}) is not allowed here")
        if token_id in self._eos:
            self._eos_accepted = True
        elif self._matcher.consume_token(token_id):
            self._num_accepted += 1
        else:
            raise GuideError(f"{self._guide.kind.value}: {self._error()}")
        self._allowed = self._blocked = None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a final EOS counts as one)."""
        if not 0 <= num_tokens <= self._num_accepted + self._eos_accepted:
            raise GuideError(f"cannot roll back {num_tokens} tokens: "
                             f"{self._num_accepted + self._eos_accepted} were accepted")
        if num_tokens and self._eos_accepted:
            self._eos_accepted = False
            num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise GuideError(f"{self._guide.kind.value}: {self._error()}")
        self._num_accepted -= num_tokens
        self._allowed = self._blocked = None

    def _compute_allowed(self) -> torch.Tensor:
        if self._eos_accepted:
            allowed = torch.zeros(self._vocab_size, dtype=torch.bool)
            allowed[list(self._eos)] = True  # a sampler that steps on can only end again
            return allowed
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        # Token 32 i + j is bit j of word i; little-endian words unpack bytes in order. Numpy,
        # not torch: single-threaded small ops are steadier next to a busy decode step.
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self._vocab_size]
        bits[self._tokenizer_size:] = 0  # padded logits (ids past the tokenizer): no token
        bits[list(self._eos)] = self._matcher.is_accepting()
        if not bits.any():
            raise GuideError(f"{self._guide.kind.value}: no token can follow: {self._error()}")
        return torch.from_numpy(bits.view(np.bool_))

    def _error(self) -> str:
        return (self._matcher.get_error() or "the grammar admits nothing here")[:_MAX_ERROR]


class GuideCompiler:
    """Built once per node from its tokenizer; compiles Guides, caching compiled grammars by
    (kind, spec, strict). Thread-safe: the front door checks while the decoder starts."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._eos = tuple(eos_token_ids)
        self._vocab_size = vocab_size
        self._tokenizer_size = tokenizer.vocab_size
        if not self._eos or not all(0 <= i < min(vocab_size, self._tokenizer_size)
                                    for i in self._eos):
            raise ConfigError(f"eos_token_ids {list(self._eos)} must be non-empty ids below "
                              f"vocab_size {vocab_size} and the tokenizer's "
                              f"{self._tokenizer_size}")
        # llguidance reads the tokenizer's own JSON (byte-level BPE, added tokens, which ones
        # are special: those are never allowed inside a grammar's text). It needs an id for
        # every tokenizer entry, so logits narrower than the tokenizer are sliced afterwards.
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer._backend.to_str(), n_vocab=max(vocab_size, self._tokenizer_size),
            eos_token=list(self._eos))
        self._cache: OrderedDict[tuple[GuideKind, str, bool], llguidance.LLMatcher] = \
            OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, loaded: TokenizedModel) -> GuideCompiler | None:
        """The compiler for a model's tokenizer (a `LoadedModel`, or the front door's
        `ModelTokenizer`), or None when it has none (then structured output is refused)."""
        if loaded.tokenizer is None:
            return None
        return cls(loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids)

    def check(self, guide: Guide) -> None:
        """GuideError naming the problem if `guide` cannot be compiled (bad JSON, an
        unsupported schema keyword, a bad regex, an unknown grammar rule...)."""
        self._compiled(guide)

    def is_compiled(self, guide: Guide) -> bool:
        """Whether `guide`'s grammar is in the cache (`start` is then a copy, microseconds)."""
        with self._lock:
            return (guide.kind, guide.spec, guide.strict) in self._cache

    def start(self, guide: Guide) -> GuideState:
        """A fresh matcher for one request, at the start of `guide`'s grammar."""
        compiled = self._compiled(guide)
        with self._lock:
            # A copy shares the parsed grammar and the lexer states found so far.
            matcher = compiled.deep_copy()
        return GuideState(matcher, guide, self._vocab_size, self._tokenizer_size, self._eos,
                          self._tokenizer)

    def _compiled(self, guide: Guide) -> llguidance.LLMatcher:
        key = (guide.kind, guide.spec, guide.strict)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        # Compile outside the lock (llguidance drops the GIL for it); a race compiles twice.
        try:
            matcher = llguidance.LLMatcher(self._tokenizer, grammar_of(guide), log_level=0)
        except GuideError:
            raise
        except Exception as error:  # the library's own checks raise more than one kind (a
            # 400-digit integer in a schema is a ValueError, a bad "x-guidance" a TypeError)
            raise GuideError(f"{guide.kind.value}: {type(error).__name__}: "
                             f"{str(error)[:_MAX_ERROR]}") from None
        if matcher.is_error():
            raise GuideError(f"{guide.kind.value}: {matcher.get_error()[:_MAX_ERROR]}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher
