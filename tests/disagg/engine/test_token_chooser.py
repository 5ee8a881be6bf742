"""The engine's token choice: log probabilities equal transformers' on the same ids, the
processors reach the sampler, and a speculative decoder verifies drafts under them (S8)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from disagg.engine.guide_spec import Guide, GuideKind
from disagg.engine.llm_engine import EngineParts, LLMEngine, build_engine, load_transformer
from disagg.engine.request import SamplingParams
from disagg.errors import RequestError
from disagg.model.loading.registry import init_random_weights
from disagg.speculative.speculator import build_speculative_engine, speculative_engine
from tests.disagg.model.test_transformer_vs_hf import make_hf_llama, random_prompts
from tests.disagg.speculative.test_speculator import Oracle

TINY = ModelConfig.from_name("tiny")
TINY_WEIGHTS = init_random_weights(TINY, seed=0)
LOGPROB_TOLERANCE = 1e-4  # fp32, the same ids through two implementations of one model


def engine_for(config: ModelConfig, weights: dict[str, torch.Tensor], page_size: int = 4,
               spec: SpeculativeConfig | None = None) -> LLMEngine:
    engine_config = EngineConfig(config, CacheConfig(page_size=page_size, num_pages=256),
                                 SchedulerConfig(chunk_size=7, max_num_batched_tokens=32))
    if spec is None:
        return build_engine(engine_config, weights)
    return build_speculative_engine(engine_config, weights, spec)


def test_logprobs_equal_transformers_log_softmax() -> None:
    """Each chosen token's logprob and the top 5 are log_softmax of transformers' logits at
    the same position, for a batch of prompts served together."""
    hf_model, config, state_dict = make_hf_llama(8, 2, tied=True)
    engine = engine_for(config, state_dict, page_size=5)
    prompts = random_prompts([3, 11, 20])
    requests = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5))
                for p in prompts]
    logprobs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for event in engine.step():
            logprobs[event.request.request_id].append(event.logprob)
    for request in requests:
        ids = torch.tensor([request.all_token_ids])
        with torch.inference_mode():
            reference = torch.log_softmax(hf_model(ids).logits[0].float(), -1)
        for i, got in enumerate(logprobs[request.request_id]):
            row = reference[request.num_prompt_tokens - 1 + i]
            assert got.token_id == request.output_token_ids[i]
            assert abs(got.logprob - float(row[got.token_id])) < LOGPROB_TOLERANCE
            top_values, top_ids = torch.topk(row, 5)
            assert [t for t, _ in got.top] == top_ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in got.top]), top_values,
                                       atol=LOGPROB_TOLERANCE, rtol=0)


def test_no_logprobs_unless_asked() -> None:
    engine = engine_for(TINY, TINY_WEIGHTS)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    events = [e for _ in range(20) if engine.has_unfinished() for e in engine.step()]
    assert events and all(e.logprob is None for e in events)


def test_a_logit_bias_reaches_the_sampler() -> None:
    """+100 on one id: greedy picks it every step."""
    engine = engine_for(TINY, TINY_WEIGHTS)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logit_bias=((42, 100.0),))
    [request] = engine.generate([[5, 6, 7]], params)
    assert request.output_token_ids == [42] * 5


def test_min_tokens_keeps_eos_away() -> None:
    """A bias makes EOS the greedy choice at once; min_tokens holds it off for 4 tokens."""
    eos = TINY.eos_token_ids[0]
    engine = engine_for(TINY, TINY_WEIGHTS)
    bias = ((eos, 100.0),)
    [early, held] = engine.generate([[5, 6, 7]] * 1, SamplingParams(
        max_tokens=8, logit_bias=bias)) + engine.generate([[5, 6, 7]], SamplingParams(
            max_tokens=8, logit_bias=bias, min_tokens=4))
    assert early.output_token_ids == [eos]
    assert len(held.output_token_ids) == 5 and held.output_token_ids[-1] == eos
    assert eos not in held.output_token_ids[:4]


def test_a_bias_outside_the_vocabulary_is_refused_at_admission() -> None:
    engine = engine_for(TINY, TINY_WEIGHTS)
    with pytest.raises(RequestError, match="logit_bias: token"):
        engine.add_request([1, 2], SamplingParams(logit_bias=((TINY.vocab_size, 1.0),)))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_drafts_are_verified_under_the_processors(wrong_every: int) -> None:
    """Greedy with a repetition penalty: drafted from the penalised reference (wrong at some
    positions), the speculative engine must give the penalised tokens; verifying against raw
    argmaxes would take other tokens."""
    params = SamplingParams(max_tokens=14, ignore_eos=True, repetition_penalty=3.0)
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 1, 2, 3, 4, 5, 6]]
    reference = [r.output_token_ids for r in engine_for(TINY, TINY_WEIGHTS).generate(
        prompts, params)]
    plain = [r.output_token_ids for r in engine_for(TINY, TINY_WEIGHTS).generate(
        prompts, SamplingParams(max_tokens=14, ignore_eos=True))]
    assert plain != reference  # the penalty changes these outputs
    engine = engine_for(TINY, TINY_WEIGHTS, spec=SpeculativeConfig("early-exit", 3,
                                                                   draft_layers=1))
    Oracle(engine, {tuple(p): r for p, r in zip(prompts, reference, strict=True)},
           wrong_at=lambda index: bool(wrong_every) and index % wrong_every == 2)
    assert [r.output_token_ids for r in engine.generate(prompts, params)] == reference
    engine.allocator.check_invariants(expect_all_free=True)


def test_speculative_logprobs_equal_the_plain_engines() -> None:
    """Tokens accepted from drafts report the same logprobs as tokens decoded one by one."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    prompt = [5, 6, 7, 8]

    def run(engine: LLMEngine) -> list:
        engine.add_request(prompt, params)
        return [e.logprob for _ in range(40) if engine.has_unfinished() for e in engine.step()]

    plain = run(engine_for(TINY, TINY_WEIGHTS))
    reference = [lp.token_id for lp in plain]
    engine = engine_for(TINY, TINY_WEIGHTS, spec=SpeculativeConfig("early-exit", 3,
                                                                   draft_layers=1))
    Oracle(engine, {tuple(prompt): reference})
    spec = run(engine)
    assert [lp.token_id for lp in spec] == reference
    for a, b in zip(plain, spec, strict=True):
        assert abs(a.logprob - b.logprob) < LOGPROB_TOLERANCE
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


class SpellingGuide:
    """A grammar that admits exactly one sequence of ids, then EOS: a stand-in for a real
    grammar library, so the engine's use of one is tested without a tokenizer."""

    def __init__(self, sequence: list[int], eos: int, vocab_size: int) -> None:
        self.sequence, self.eos, self.vocab_size = sequence, eos, vocab_size
        self.position = 0
        self.finished = False

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.sequence[self.position] if self.position < len(self.sequence) else self.eos
        blocked = torch.ones(self.vocab_size, dtype=torch.bool)
        blocked[allowed] = False
        return logits.masked_fill_(blocked, float("-inf"))

    def accept(self, token_id: int) -> None:
        expected = self.sequence[self.position] if self.position < len(self.sequence) else (
            self.eos)
        assert token_id == expected, f"the engine appended {token_id}, the grammar wants {expected}"
        self.position += 1

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= self.position
        self.position -= num_tokens

    @property
    def is_finished(self) -> bool:
        return self.position > len(self.sequence)


class SpellingCompiler:
    """Never has a grammar cached: each one "compiles" on the chooser's thread, waiting for
    `release` (set by default), or raising for the spec "fail"."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.release = threading.Event()
        self.release.set()

    def is_compiled(self, guide: object) -> bool:
        return False

    def start(self, guide: object) -> SpellingGuide:
        assert threading.current_thread() is not threading.main_thread(), (
            "a grammar compiled on the engine's thread")
        self.release.wait(10)
        if guide.spec == "fail":
            raise ValueError("the library chokes on this spec")
        return SpellingGuide(json.loads(guide.spec), TINY.eos_token_ids[0], self.vocab_size)


SPELLED = [17, 4, 99, 4, 4, 23]


def guided_engine(spec: SpeculativeConfig | None = None,
                  compiler: SpellingCompiler | None = None) -> LLMEngine:
    config = EngineConfig(TINY, CacheConfig(page_size=4, num_pages=256),
                          SchedulerConfig(chunk_size=7, max_num_batched_tokens=32))
    parts = EngineParts.build(config, load_transformer(config, TINY_WEIGHTS),
                              compiler or SpellingCompiler(TINY.vocab_size))  # type: ignore[arg-type]
    return LLMEngine(parts) if spec is None else speculative_engine(parts, spec)


def test_the_grammar_masks_every_token_it_chooses() -> None:
    """Whatever the random model prefers, the output is the grammar's, then EOS ends it."""
    engine = guided_engine()
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=3,
                            guide=Guide(GuideKind.REGEX, json.dumps(SPELLED)))
    [request] = engine.generate([[5, 6, 7]], params)
    assert request.output_token_ids == [*SPELLED, TINY.eos_token_ids[0]]
    engine.allocator.check_invariants(expect_all_free=True)


@pytest.mark.parametrize("wrong_every", [0, 2])
def test_drafts_are_verified_under_the_grammar(wrong_every: int) -> None:
    """Drafts from the grammar's own sequence, wrong at some positions: the wrong ones are
    rejected under the mask, the grammar rolls back over every tentative draft, and the
    output is the grammar's."""
    engine = guided_engine(SpeculativeConfig("early-exit", 3, draft_layers=1))
    prompt = [5, 6, 7]
    Oracle(engine, {tuple(prompt): [*SPELLED, TINY.eos_token_ids[0]] + [1] * 8},
           wrong_at=lambda index: bool(wrong_every) and index % wrong_every == 1)
    params = SamplingParams(max_tokens=20, guide=Guide(GuideKind.REGEX, json.dumps(SPELLED)))
    [request] = engine.generate([prompt], params)
    assert request.output_token_ids == [*SPELLED, TINY.eos_token_ids[0]]


def test_a_guided_request_without_a_compiler_is_refused() -> None:
    engine = engine_for(TINY, TINY_WEIGHTS)
    with pytest.raises(RequestError, match="tokenizer"):
        engine.add_request([1, 2], SamplingParams(guide=Guide(GuideKind.JSON_OBJECT)))


def test_admission_does_not_wait_for_a_grammar_to_compile() -> None:
    """The compile runs on the chooser's thread: admitting returns at once, the request's
    first sampled token waits for it, and the output is the grammar's."""
    compiler = SpellingCompiler(TINY.vocab_size)
    compiler.release.clear()  # the compile cannot finish until the test says so
    engine = guided_engine(compiler=compiler)
    params = SamplingParams(max_tokens=20, guide=Guide(GuideKind.REGEX, json.dumps(SPELLED)))
    request = engine.add_request([5, 6, 7], params)  # returns: it did not compile here
    assert not request.output_token_ids
    compiler.release.set()
    while engine.has_unfinished():
        engine.step()
    assert request.output_token_ids == [*SPELLED, TINY.eos_token_ids[0]]


def test_a_grammar_that_fails_to_compile_fails_its_request_alone() -> None:
    engine = guided_engine()
    bad = engine.add_request([5, 6, 7], SamplingParams(
        max_tokens=4, guide=Guide(GuideKind.REGEX, "fail")))
    good = engine.add_request([5, 6, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    [failure] = engine.take_failures()
    assert failure.request is bad and "chokes" in failure.detail
    assert len(good.output_token_ids) == 4
    engine.allocator.check_invariants(expect_all_free=True)
