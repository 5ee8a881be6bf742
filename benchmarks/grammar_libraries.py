"""xgrammar against llguidance on the same JSON schemas, with SmolLM2-135M's tokenizer (S8).

    python benchmarks/grammar_libraries.py [--walks 10] [--json] [--out FILE]

The evidence behind `disagg/engine/guided.py`'s choice of library. Each library runs in a
subprocess of its own, so import time and memory are its alone, and each is set up as the
module would use it (whitespace runs bounded to WHITESPACE_MAX characters). Per schema: cold
compile time (median of 3) and the first mask; seeded random walks (each step samples an
allowed token, structural tokens weighted up so strings close within CAP), whose text must
`json.loads` and pass `jsonschema`; a valid instance (compact and indented) must be accepted
and an invalid one refused. Per token: mask fill, accept and the library's CPU apply over the
vocab of 49,152. Also resident memory, whether a special token other than EOS is ever
allowed, and schemas with keywords a library may not implement: refused, enforced or ignored
(an instance breaking only that keyword is accepted). Last, the same walks through
`disagg.engine.guided` itself: what the sampler pays per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LIBRARIES = ("xgrammar", "llguidance")
CAP = 300  # tokens per walk
WHITESPACE_MAX = 24  # as disagg/engine/guide_spec.py bounds a run of JSON whitespace
OBJ = {"type": "object", "additionalProperties": False}
# name -> (schema, a valid instance, an invalid instance)
SCHEMAS: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "flat": ({**OBJ, "properties": {"name": {"type": "string", "maxLength": 12},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"]}, {"name": "Ann", "age": 31}, {"name": "Ann"}),
    "nested": ({**OBJ, "properties": {
        "user": {**OBJ, "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
            "required": ["id", "tags"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
        {"user": {"id": 7, "tags": ["a", "b"]}, "active": True},
        {"user": {"id": "7", "tags": []}, "active": True}),
    "enum": ({**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]},
                                    "size": {"enum": [1, 2, 3]}}, "required": ["color", "size"]},
             {"color": "red", "size": 2}, {"color": "pink", "size": 2}),
    "scalars": ({**OBJ, "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"},
                                       "nothing": {"type": "null"}, "n": {"type": "integer"}},
                 "required": ["x", "ok", "nothing", "n"]},
                {"x": -1.5e3, "ok": False, "nothing": None, "n": 12},
                {"x": 1, "ok": "no", "nothing": None, "n": 1}),
    "pattern": ({**OBJ, "properties": {"code": {"type": "string",
                                                "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                 "required": ["code"]}, {"code": "ABC-123"}, {"code": "abc-123"}),
    "optional": ({**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "string",
                                                                         "maxLength": 6},
                                        "c": {"type": "boolean"}}, "required": ["a"]},
                 {"a": 1, "c": True}, {"b": "x"}),
    "ref_anyof": ({"$defs": {"id": {"anyOf": [{"type": "integer"},
                                              {"type": "string", "maxLength": 6}]}},
                   **OBJ, "properties": {"ids": {"type": "array", "items": {"$ref": "#/$defs/id"},
                                                 "minItems": 1, "maxItems": 4}},
                   "required": ["ids"]}, {"ids": [1, "x"]}, {"ids": []}),
    "tool_call": ({**OBJ, "properties": {"name": {"const": "get_weather"}, "arguments": {
        **OBJ, "properties": {"city": {"type": "string", "maxLength": 16},
                              "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}, "required": ["name", "arguments"]},
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
        {"name": "get_time", "arguments": {"city": "Oslo", "unit": "celsius"}}),
    "array_of_objects": ({"type": "array", "minItems": 1, "maxItems": 3, "items": {
        **OBJ, "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "number"}},
        "required": ["k", "v"]}}, [{"k": "a", "v": 1}], [{"k": "a"}]),
    "any_object": ({"type": "object"}, {"x": [1, {"y": None}]}, [1]),
}
# Keywords a library may not implement, each with an instance that breaks only that keyword:
# the library should refuse the schema or refuse the instance, not accept it.
PROBES: dict[str, tuple[dict[str, Any], Any]] = {
    "not": ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, {"a": "s"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
                          {"x1": "s"}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "if_then": ({"type": "object", "properties": {"a": {"type": "integer"},
                                                  "b": {"type": "integer"}},
                 "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    "multipleOf": ({"type": "integer", "multipleOf": 7}, 8),
    "minLength": ({"type": "string", "minLength": 3}, "ab"),
    "format_date": ({"type": "string", "format": "date"}, "yesterday"),
    "bad_type": ({"type": "integr"}, 1),
}


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class XGrammar:
    """xgrammar 0.2: a GrammarCompiler (no cache: cold compiles) and one GrammarMatcher each."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        backend = tokenizer._backend
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        vocab = [""] * vocab_size
        for text, index in backend.get_vocab(with_added_tokens=True).items():
            vocab[index] = text
        info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=eos, add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any], bounded: bool = True) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), max_whitespace_cnt=WHITESPACE_MAX if bounded else None)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(torch.from_numpy(bitmask))

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def finished(self, matcher: Any) -> bool:
        return matcher.is_terminated()

    def apply(self, logits: np.ndarray, bitmask: np.ndarray) -> None:
        self.xgr.apply_token_bitmask_inplace(torch.from_numpy(logits), torch.from_numpy(bitmask))


class LLGuidance:
    """llguidance 1.9: a pristine LLMatcher per schema, deep-copied per walk (as the module
    does: a copy keeps the parsed grammar and the masks already computed). Its numpy helpers,
    not llguidance.torch, whose apply is torch.compile'd (seconds to import)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        import llguidance as llg
        import llguidance.numpy as llg_numpy

        self.llg, self.llg_numpy = llg, llg_numpy
        self.tokenizer = llg.LLTokenizer(tokenizer._backend.to_str(), n_vocab=vocab_size,
                                         eos_token=eos)

    def compile(self, schema: dict[str, Any], bounded: bool = True) -> Any:
        whitespace = f"[\\x20\\x0A\\x0D\\x09]{{0,{WHITESPACE_MAX}}}"
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_pattern": whitespace} if bounded else None)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        self.llg_numpy.fill_next_token_bitmask(matcher, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        # A refused token leaves an LLMatcher in an error state for good: check it first.
        # Once stopped (nothing but EOS can follow), validate_tokens counts EOS as 0.
        if token in self.tokenizer.eos_tokens:
            return matcher.is_accepting() and matcher.consume_token(token)
        return matcher.validate_tokens([token]) == 1 and matcher.consume_token(token)

    def finished(self, matcher: Any) -> bool:
        return matcher.is_stopped()

    def apply(self, logits: np.ndarray, bitmask: np.ndarray) -> None:
        self.llg_numpy.apply_token_bitmask_inplace(logits, bitmask)


def unpack(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size] from an int32 bitmask [1, ceil(vocab_size / 32)]: token 32 i + j is
    bit j of word i (little-endian words, so the bytes unpack in order)."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


class Walker:
    """Seeded random walks through one library's matchers, timing every call."""

    def __init__(self, lib: Any, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        self.lib, self.tokenizer, self.vocab_size, self.eos = lib, tokenizer, vocab_size, eos
        texts = [tokenizer.decode([i]) for i in range(vocab_size)]
        structural = torch.tensor([any(c in t for c in '"}],') for t in texts])
        self.weights = torch.where(structural, 200.0, 1.0)
        self.weights[eos] = 1000.0
        self.special = [i for i, t in tokenizer._backend.get_added_tokens_decoder().items()
                        if t.special and i not in eos]
        self.bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
        self.generator = torch.Generator().manual_seed(0)
        self.us: dict[str, list[float]] = {"fill": [], "accept": [], "apply": []}
        self.special_allowed_steps = 0

    def timed(self, kind: str, call: Any, *args: Any) -> Any:
        start = time.perf_counter_ns()
        result = call(*args)
        self.us[kind].append((time.perf_counter_ns() - start) / 1e3)
        return result

    def walk(self, compiled: Any) -> tuple[str, bool, str]:
        """(text, finished, error) of one walk of at most CAP tokens."""
        lib, matcher, ids = self.lib, self.lib.matcher(compiled), []
        while len(ids) < CAP and not lib.finished(matcher):
            self.timed("fill", lib.fill, matcher, self.bitmask)
            allowed = unpack(self.bitmask, self.vocab_size)
            self.special_allowed_steps += bool(allowed[self.special].any())
            logits = torch.randn(1, self.vocab_size, generator=self.generator).numpy()
            self.timed("apply", lib.apply, logits, self.bitmask)
            token = int(torch.multinomial(self.weights * allowed, 1, generator=self.generator))
            if not self.timed("accept", lib.accept, matcher, token):
                return "", False, f"allowed token {token} refused"
            ids.append(token)
        return self.tokenizer.decode([i for i in ids if i not in self.eos]), \
            lib.finished(matcher), ""

    def validates(self, compiled: Any, schema: dict[str, Any]) -> tuple[bool, str]:
        """Whether one walk's text is JSON valid for `schema` (else why not)."""
        text, _, error = self.walk(compiled)
        if error:
            return False, error
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as invalid:
            return False, f"{text[:60]!r}: {str(invalid).splitlines()[0][:80]}"
        return True, ""


def measure(name: str, walks: int) -> dict[str, Any]:
    """Everything about one library, in this (fresh) process."""
    from disagg.model.loading.registry import load_model

    # One torch thread: the costs per token, not how a busy machine schedules a thread pool.
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m")
    tokenizer, vocab_size = loaded.tokenizer, loaded.config.vocab_size
    eos = list(loaded.config.eos_token_ids)
    rss0 = rss_mib()
    start = time.perf_counter()
    lib = (XGrammar if name == "xgrammar" else LLGuidance)(tokenizer, vocab_size, eos)
    setup_s = time.perf_counter() - start
    rss_setup = rss_mib()
    walker = Walker(lib, tokenizer, vocab_size, eos)
    schemas: dict[str, Any] = {}
    for schema_name, (schema, good, bad) in SCHEMAS.items():
        row: dict[str, Any] = {}
        for bounded, key in ((False, "compile_ms_unbounded_whitespace"), (True, "compile_ms")):
            compile_s = []
            for _ in range(3):
                start = time.perf_counter()
                compiled = lib.compile(schema, bounded)
                compile_s.append(time.perf_counter() - start)
            row[key] = statistics.median(compile_s) * 1e3
        start = time.perf_counter()
        lib.fill(lib.matcher(compiled), walker.bitmask)
        row["first_mask_ms"] = (time.perf_counter() - start) * 1e3
        results = [walker.validates(compiled, schema) for _ in range(walks)]
        row["valid"] = sum(ok for ok, _ in results)
        row["errors"] = [why for ok, why in results if not ok]
        row["accepts_valid"] = all(accepts(lib, compiled, tokenizer, good, indent)
                                   for indent in (None, 2))
        row["refuses_invalid"] = not accepts(lib, compiled, tokenizer, bad, None)
        if name == "xgrammar":
            row["compiled_bytes"] = compiled.memory_size_bytes
        schemas[schema_name] = row
    rss_all = rss_mib()
    # Not JSON, yet a string's content to a library that misreads it: a raw control character
    # (JSON wants it escaped) and a chat template's special token.
    any_object = lib.compile({"type": "object"})
    bounded = lib.compile({"type": "object", "properties": {"x": {"type": "string",
                                                                 "maxLength": 6}}})
    not_json = {"raw_control_char_in_string": accepts_text(lib, any_object, tokenizer,
                                                           '{"x": "a\x19b"}'),
                "raw_control_char_in_maxLength_string": accepts_text(lib, bounded, tokenizer,
                                                                     '{"x": "a\x19b"}'),
                "im_start_token_in_string": accepts_text(lib, any_object, tokenizer,
                                                         '{"x": "<|im_start|>"}')}
    probes = {}
    for probe, (schema, bad) in PROBES.items():
        try:
            compiled = lib.compile(schema)
        except Exception as error:  # each library raises its own kinds
            probes[probe] = f"schema refused: {str(error).splitlines()[0][-60:]}"
            continue
        probes[probe] = ("IGNORED (breaking instance accepted)"
                         if accepts(lib, compiled, tokenizer, bad, None) else "enforced")
    module = module_us(walker, walks) if name == "llguidance" else None
    return {"library": name, "setup_s": setup_s, "walks_per_schema": walks, "module_us": module,
            "rss_mib": {"before": rss0, "after_setup": rss_setup, "after_all": rss_all},
            "special_allowed_steps": walker.special_allowed_steps, "not_json_accepted": not_json,
            **{f"{kind}_us": summary(v) for kind, v in walker.us.items()},
            "schemas": schemas, "probes": probes}


def module_us(walker: Walker, walks: int) -> dict[str, dict[str, float]]:
    """Per token through `disagg.engine.guided` itself (llguidance underneath): mask_logits
    (which computes allowed()) on CPU logits, then accept."""
    from disagg.engine.guided import Guide, GuideCompiler, GuideKind

    compiler = GuideCompiler(walker.tokenizer, walker.vocab_size, walker.eos)
    us: dict[str, list[float]] = {"mask_logits": [], "accept": []}
    for schema, _, _ in SCHEMAS.values():
        guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(schema))
        for _ in range(walks):
            state, steps = compiler.start(guide), 0
            while steps < CAP and not state.is_finished:
                logits = torch.randn(walker.vocab_size, generator=walker.generator)
                start = time.perf_counter_ns()
                state.mask_logits(logits)
                us["mask_logits"].append((time.perf_counter_ns() - start) / 1e3)
                token = int(torch.multinomial(walker.weights * state.allowed(), 1,
                                              generator=walker.generator))
                start = time.perf_counter_ns()
                state.accept(token)
                us["accept"].append((time.perf_counter_ns() - start) / 1e3)
                steps += 1
    return {kind: summary(v) for kind, v in us.items()}


def accepts(lib: Any, compiled: Any, tokenizer: Any, instance: Any, indent: int | None) -> bool:
    """Whether the tokens of `instance` as json.dumps writes it are accepted, then EOS."""
    return accepts_text(lib, compiled, tokenizer, json.dumps(instance, indent=indent))


def accepts_text(lib: Any, compiled: Any, tokenizer: Any, text: str) -> bool:
    """Whether the tokens of `text` (special markers as their own ids) are accepted, then EOS."""
    matcher = lib.matcher(compiled)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(lib.accept(matcher, i) for i in ids + list(tokenizer.eos_token_ids))


def summary(samples: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(samples, 50)), "p99": float(np.percentile(samples, 99)),
            "mean": float(np.mean(samples)), "n": len(samples)}


def import_time(name: str) -> float:
    """Seconds to import the library (after torch, which both need) in a fresh interpreter."""
    code = (f"import time, torch; t = time.perf_counter(); import {name}; "
            "print(time.perf_counter() - t)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


def print_table(results: list[dict[str, Any]]) -> None:
    console = Console(width=max(Console().width, 110))
    table = Table(title="per schema: compile ms (cold; with unbounded whitespace) / first mask "
                  "ms / walks valid; (!): a valid instance refused or an invalid one accepted")
    table.add_column("schema")
    for r in results:
        table.add_column(r["library"], justify="right")
    for schema in SCHEMAS:
        cells = []
        for r in results:
            s = r["schemas"][schema]
            cells.append(f"{s['compile_ms']:.2f} ({s['compile_ms_unbounded_whitespace']:.2f}) / "
                         f"{s['first_mask_ms']:.2f} / "
                         f"{s['valid']}/{r['walks_per_schema']}"
                         f"{'' if s['accepts_valid'] and s['refuses_invalid'] else ' (!)'}")
        table.add_row(schema, *cells)
    console.print(table)
    table = Table(title="per token (µs, vocab 49,152) and process")
    for col in ("library", "fill p50", "fill p99", "accept p50", "apply p50", "import s",
                "setup s", "RSS +MiB", "steps w/ special"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["library"], f"{r['fill_us']['p50']:.0f}", f"{r['fill_us']['p99']:.0f}",
                      f"{r['accept_us']['p50']:.0f}", f"{r['apply_us']['p50']:.0f}",
                      f"{r['import_s']:.2f}", f"{r['setup_s']:.2f}",
                      f"{r['rss_mib']['after_all'] - r['rss_mib']['before']:.0f}",
                      str(r["special_allowed_steps"]))
    console.print(table)
    for r in results:
        bad = [k for k, v in r["not_json_accepted"].items() if v]
        console.print(f"{r['library']}: not JSON but accepted: {', '.join(bad) or 'none'}")
    for r in results:
        if r["module_us"]:
            m = r["module_us"]
            console.print(f"disagg.engine.guided over {r['library']}, per token (µs): mask_logits "
                          f"p50 {m['mask_logits']['p50']:.0f} p99 {m['mask_logits']['p99']:.0f}, "
                          f"accept p50 {m['accept']['p50']:.0f} p99 {m['accept']['p99']:.0f}")
    table = Table(title="keywords a library may not implement")
    table.add_column("schema")
    for r in results:
        table.add_column(r["library"])
    for probe in PROBES:
        table.add_row(probe, *[r["probes"][probe] for r in results])
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=10, help="random walks per schema")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--library", choices=LIBRARIES, help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.library:
        print(json.dumps(measure(args.library, args.walks)))
        return 0
    results = []
    for name in LIBRARIES:
        child = subprocess.run([sys.executable, __file__, "--library", name,
                                "--walks", str(args.walks)], capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"{name}: the measuring process failed:\n{child.stderr[-3000:]}")
        results.append(json.loads(child.stdout) | {"import_s": import_time(name)})
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
