"""Structured output: every walk a mask allows ends in text its grammar accepts (SmolLM2's
tokenizer, 49,152 ids); refusals, rollback and the mask itself are exact.

A walk samples among the allowed tokens with structural ones (a quote, brace, bracket or
comma) and EOS weighted up, so strings close and walks end well within the cap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from disagg.engine.guided import Guide, GuideCompiler, GuideKind, GuideState
from disagg.errors import GuideError
from disagg.model.loading.registry import LoadedModel

CAP = 300
OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_required": {**OBJ, "properties": {"name": {"type": "string", "maxLength": 10},
                                            "age": {"type": "integer", "minimum": 0}},
                      "required": ["name", "age"]},
    "nested": {**OBJ, "properties": {
        "user": {**OBJ, "properties": {"id": {"type": "integer"},
                                       "tags": {"type": "array", "items": {"type": "string"},
                                                "maxItems": 3}},
                 "required": ["id", "tags"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "enums": {**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]},
                                    "size": {"enum": [1, 2, 3]}}, "required": ["color", "size"]},
    "scalars": {**OBJ, "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"},
                                      "nothing": {"type": "null"}, "n": {"type": "integer"}},
                "required": ["x", "ok", "nothing", "n"]},
    "pattern": {**OBJ, "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                "required": ["code"]},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        **OBJ, "properties": {"k": {"type": "string"}, "v": {"type": ["number", "null"]}},
        "required": ["k", "v"]}},
}
TOOL = {**OBJ, "properties": {"name": {"const": "get_weather"}, "arguments": {
    **OBJ, "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    "required": ["name", "arguments"]}


@pytest.fixture(scope="module")
def compiler(smollm2_model: LoadedModel) -> GuideCompiler:
    config = smollm2_model.config
    return GuideCompiler(smollm2_model.tokenizer, config.vocab_size, config.eos_token_ids)


@pytest.fixture(scope="module")
def weights(smollm2_model: LoadedModel) -> torch.Tensor:
    """[vocab_size] walk weights: 200 for structural tokens, 1000 for EOS, 1 otherwise."""
    backend = smollm2_model.tokenizer._backend
    texts = backend.decode_batch([[i] for i in range(smollm2_model.config.vocab_size)])
    weights = torch.tensor([200.0 if any(c in t for c in '"}],') else 1.0 for t in texts])
    weights[list(smollm2_model.config.eos_token_ids)] = 1000.0
    return weights


Walk = Callable[..., str]


@pytest.fixture(scope="module")
def walk(compiler: GuideCompiler, weights: torch.Tensor, smollm2_model: LoadedModel) -> Walk:
    """walk(guide, seed, greedy=False) -> the text of one walk that finished within CAP."""
    tokenizer = smollm2_model.tokenizer

    def run(guide: Guide, seed: int, greedy: bool = False) -> str:
        state, ids = compiler.start(guide), []
        generator = torch.Generator().manual_seed(seed)
        while not state.is_finished and len(ids) < CAP:
            if greedy:  # argmax of random logits, biased like the weights, masked
                logits = torch.randn(weights.shape, generator=generator) + weights.log()
                token = int(state.mask_logits(logits).argmax())
            else:
                token = int(torch.multinomial(weights * state.allowed(), 1,
                                              generator=generator))
            state.accept(token)
            ids.append(token)
        assert state.is_finished, f"no end within {CAP} tokens: {tokenizer.decode(ids)!r}"
        return tokenizer.decode(ids, skip_special_tokens=True)

    return run


def accept_text(state: GuideState, tokenizer: Any, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        state.accept(token)


@pytest.mark.parametrize("name", SCHEMAS)
def test_random_walks_validate(walk: Walk, name: str) -> None:
    """Random walks through a schema's masks give JSON that `jsonschema` accepts."""
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS[name]))
    for seed in range(3):
        jsonschema.validate(json.loads(walk(guide, seed)), SCHEMAS[name])


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_walks_over_random_logits_validate(walk: Walk, name: str) -> None:
    """Argmax of masked random logits (so mask_logits alone keeps them in the grammar)."""
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS[name]))
    for seed in range(2):
        jsonschema.validate(json.loads(walk(guide, seed, greedy=True)), SCHEMAS[name])


def test_json_object_gives_an_object(walk: Walk) -> None:
    for seed in range(4):
        assert isinstance(json.loads(walk(Guide(GuideKind.JSON_OBJECT), seed)), dict)


@pytest.mark.parametrize("regex", [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}",
                                   r"(yes|no|maybe)!?"])
def test_regex_output_fully_matches(walk: Walk, regex: str) -> None:
    for seed in range(3):
        text = walk(Guide(GuideKind.REGEX, regex), seed)
        assert re.fullmatch(regex, text), text


def test_choice_gives_exactly_one_string(walk: Walk) -> None:
    """Choices sharing a prefix: each walk is one of them whole, and more than one occurs."""
    choices = ["yes", "yes, please", "no", "maybe later"]
    texts = {walk(Guide(GuideKind.CHOICE, json.dumps(choices)), seed) for seed in range(12)}
    assert texts <= set(choices)
    assert len(texts) > 1


def test_tagged_json_is_begin_value_end(walk: Walk) -> None:
    begin, end = "<tool_call>\n", "\n</tool_call>"
    guide = Guide(GuideKind.TAGGED_JSON, json.dumps({"begin": begin, "schema": TOOL,
                                                     "end": end}))
    for seed in range(3):
        text = walk(guide, seed)
        assert text.startswith(begin), text
        assert text.endswith(end), text
        jsonschema.validate(json.loads(text[len(begin):-len(end)]), TOOL)


def test_lark_grammar_gives_a_sentence_of_it(walk: Walk) -> None:
    """Nested sums and products of small numbers: reduce innermost pairs to one number."""
    lark = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/'
    for seed in range(4):
        text = walk(Guide(GuideKind.GRAMMAR, lark), seed)
        reduced = text
        while (shorter := re.sub(r"\([0-9]+[+*][0-9]+\)", "0", reduced)) != reduced:
            reduced = shorter
        assert re.fullmatch(r"[0-9]{1,3}", reduced), text


def test_gbnf_grammar_is_accepted_too(walk: Walk) -> None:
    for seed in range(3):
        assert re.fullmatch(r"(yes|no)!", walk(Guide(GuideKind.GRAMMAR,
                                                     'root ::= ("yes" | "no") "!"'), seed))


def test_token_not_allowed_raises_and_leaves_state(compiler: GuideCompiler,
                                                   smollm2_model: LoadedModel) -> None:
    """A refused token names itself; the state is where it was, and goes on."""
    state = compiler.start(Guide(GuideKind.JSON_OBJECT))
    before = state.allowed().clone()
    (hello,) = smollm2_model.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(GuideError, match=f"token {hello}"):
        state.accept(hello)
    assert torch.equal(state.allowed(), before)
    accept_text(state, smollm2_model.tokenizer, '{"a": 1}')


def test_eos_is_refused_before_the_end(compiler: GuideCompiler) -> None:
    state = compiler.start(Guide(GuideKind.JSON_OBJECT))
    assert not state.allowed()[2]
    with pytest.raises(GuideError, match="not allowed"):
        state.accept(2)


@pytest.mark.parametrize(("kind", "spec", "problem"), [
    (GuideKind.JSON_SCHEMA, "{nope", "not valid JSON"),
    (GuideKind.JSON_SCHEMA, "[1]", "a JSON object, got an array"),
    (GuideKind.JSON_SCHEMA, '{"type": "integr"}', "integr"),
    (GuideKind.JSON_SCHEMA, '{"not": {"type": "string"}}', r'Unimplemented keys: \["not"\]'),
    (GuideKind.JSON_SCHEMA, '{"properties": {"a": {"$ref": "#/$defs/b"}}}', "/[$]defs/b"),
    (GuideKind.JSON_OBJECT, "{}", "takes no spec"),
    (GuideKind.REGEX, "a(b", "unclosed group"),
    (GuideKind.CHOICE, '"yes"', "non-empty JSON list"),
    (GuideKind.CHOICE, "[]", "non-empty JSON list"),
    (GuideKind.GRAMMAR, "start: foo", 'unknown name: "foo"'),
    (GuideKind.GRAMMAR, 'root ::= "yes" | (', "GBNF"),
    (GuideKind.TAGGED_JSON, '{"begin": "<a>", "schema": {}}', '"end"'),
    (GuideKind.TAGGED_JSON, '{"begin": 1, "schema": {}, "end": ""}', "must be strings"),
])
def test_check_names_the_problem(compiler: GuideCompiler, kind: GuideKind, spec: str,
                                 problem: str) -> None:
    with pytest.raises(GuideError, match=problem):
        compiler.check(Guide(kind, spec))


def test_not_strict_ignores_what_it_cannot_enforce(compiler: GuideCompiler) -> None:
    """strict=False compiles a schema with `not`; strict (the default) refuses it."""
    schema = json.dumps({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    compiler.check(Guide(GuideKind.JSON_SCHEMA, schema, strict=False))
    assert compiler.start(Guide(GuideKind.JSON_SCHEMA, schema, strict=False)).allowed().any()


def test_rollback_restores_every_earlier_position(compiler: GuideCompiler,
                                                  smollm2_model: LoadedModel) -> None:
    """20 tokens then EOS, rolled back in steps: each position's mask is as it was."""
    tokenizer = smollm2_model.tokenizer
    ids = tokenizer.encode('{"a": [1, 2, 3, 4, 5, 6], "b": "text"}', add_special_tokens=False)
    ids = [*ids, 2]
    assert len(ids) > 20
    state = compiler.start(Guide(GuideKind.JSON_OBJECT))
    seen = []
    for token in ids:
        seen.append(state.allowed().clone())
        state.accept(token)
    assert state.is_finished
    state.rollback(1)  # the EOS
    assert torch.equal(state.allowed(), seen[-1])
    state.rollback(5)
    assert torch.equal(state.allowed(), seen[-6])
    state.rollback(len(ids) - 6)
    assert torch.equal(state.allowed(), seen[0])
    with pytest.raises(GuideError, match="cannot roll back 1"):
        state.rollback(1)
    for token in ids:  # and the same tokens are taken again
        state.accept(token)


def test_finished_allows_only_eos_and_then_nothing(compiler: GuideCompiler,
                                                   smollm2_model: LoadedModel) -> None:
    state = compiler.start(Guide(GuideKind.REGEX, "ab(cd)?"))
    accept_text(state, smollm2_model.tokenizer, "ab")
    assert state.allowed()[2]  # may end
    assert not state.is_finished  # or go on
    accept_text(state, smollm2_model.tokenizer, "cd")
    assert state.is_finished
    assert state.allowed().nonzero().flatten().tolist() == [2]
    state.accept(2)
    with pytest.raises(GuideError, match="after the end"):
        state.accept(2)


def test_mask_logits_blocks_exactly_the_disallowed(compiler: GuideCompiler,
                                                   smollm2_model: LoadedModel) -> None:
    """In place, for [vocab] and [1, vocab]: -inf where not allowed, untouched elsewhere."""
    state = compiler.start(Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS["enums"])))
    accept_text(state, smollm2_model.tokenizer, '{"color": ')
    allowed = state.allowed()
    assert 0 < int(allowed.sum()) < 1000  # the enum's openings, after some whitespace
    for shape in ([allowed.numel()], [1, allowed.numel()]):
        logits = torch.randn(shape)
        masked = state.mask_logits(logits.clone())
        assert torch.equal(torch.isneginf(masked).view(-1), ~allowed)
        assert torch.equal(masked.view(-1)[allowed], logits.view(-1)[allowed])
    with pytest.raises(ValueError, match="logits must be"):
        state.mask_logits(torch.zeros(2, allowed.numel()))


def test_ids_past_the_tokenizer_are_never_allowed(smollm2_model: LoadedModel) -> None:
    """Logits padded 64 ids wider than the tokenizer: masks are that wide, the pad blocked."""
    tokenizer = smollm2_model.tokenizer
    padded = GuideCompiler(tokenizer, tokenizer.vocab_size + 64, (2,))
    state = padded.start(Guide(GuideKind.JSON_OBJECT))
    accept_text(state, tokenizer, '{"a": "')  # inside a string nearly every token may come
    allowed = state.allowed()
    assert allowed.shape == (tokenizer.vocab_size + 64,)
    assert allowed[:tokenizer.vocab_size].sum() > 40_000
    assert not allowed[tokenizer.vocab_size:].any()
    assert torch.isneginf(state.mask_logits(torch.zeros(allowed.numel()))[-64:]).all()
    with pytest.raises(GuideError):
        state.accept(tokenizer.vocab_size + 3)


def test_states_of_one_guide_are_independent(compiler: GuideCompiler,
                                             smollm2_model: LoadedModel) -> None:
    guide = Guide(GuideKind.JSON_OBJECT)
    first, second = compiler.start(guide), compiler.start(guide)
    accept_text(first, smollm2_model.tokenizer, '{"a"')
    assert not torch.equal(first.allowed(), second.allowed())
    assert torch.equal(second.allowed(), compiler.start(guide).allowed())


@pytest.mark.parametrize("spec", [
    Guide(GuideKind.JSON_SCHEMA, '{"type": "integer", "maximum": ' + "9" * 400 + "}"),
    Guide(GuideKind.TAGGED_JSON, '{"begin": "<", "schema": {"x-guidance": 3}, "end": ">"}'),
], ids=["huge-integer", "bad-x-guidance"])
def test_what_the_library_itself_chokes_on_is_a_guide_error(compiler: GuideCompiler,
                                                             spec: Guide) -> None:
    """The library raises ValueError or TypeError for these: they must be GuideErrors (a 400
    at the front door, a refused request at a decoder), never an exception that stops a
    node."""
    with pytest.raises(GuideError):
        compiler.check(spec)
