"""One prompt, one node, start to finish: what `disagg generate` runs (S1).

Loads the model, builds an `LLMEngine` with the requested cache and scheduler settings, streams
text as tokens arrive and returns a JSON-ready summary. With a `Tracer`, every engine step is a
span in a Chrome trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from disagg.config import EngineConfig, SpeculativeConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import SamplingParams
from disagg.errors import ConfigError, RequestError
from disagg.model.loading.registry import load_model
from disagg.model.loading.tokenizer import StreamDecoder, Tokenizer
from disagg.speculative.speculator import build_speculative_engine
from disagg.utils.trace import Tracer


def generate_one(model_spec: str, config: EngineConfig, *, prompt: str | None,
                 prompt_token_ids: list[int] | None, max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 on_text: Callable[[str], None] | None = None,
                 tracer: Tracer | None = None,
                 speculative: SpeculativeConfig | None = None,
                 on_loaded: Callable[[], None] | None = None) -> dict[str, Any]:
    """Generate for one prompt (text or ids); `on_text` receives text as it decodes; `tracer`
    records each step; `speculative` drafts and verifies (S8); `on_loaded` is called once the
    model is loaded and the engine built, before the first step."""
    loaded = load_model(model_spec)
    tokenizer = loaded.tokenizer
    if prompt is not None:
        if tokenizer is None:
            raise RequestError(f"model {model_spec!r} has no tokenizer: use --prompt-token-ids")
        prompt_token_ids = tokenizer.encode(prompt)
    assert prompt_token_ids is not None
    if not prompt_token_ids:
        raise RequestError("the prompt is empty")
    if max(prompt_token_ids) >= loaded.config.vocab_size:
        raise RequestError(f"token id {max(prompt_token_ids)} is outside the vocabulary of "
                           f"{loaded.config.vocab_size}")
    config = replace(config, model=loaded.config)
    if speculative is not None and config.parallel.tp > 1:
        raise ConfigError(f"--speculative runs on one process: not with TP {config.parallel.tp}")
    engine = (build_engine(config, loaded.state_dict, model_spec=model_spec)
              if speculative is None
              else build_speculative_engine(config, loaded.state_dict, speculative))
    if on_loaded is not None:
        on_loaded()
    try:
        return _generate(engine, tokenizer, prompt_token_ids, model_spec,
                         SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                        top_p=top_p, top_k=top_k, seed=seed),
                         on_text, tracer, speculative)
    finally:
        engine.close()  # the TP ranks, if any


def _generate(engine: LLMEngine, tokenizer: Tokenizer | None, prompt_token_ids: list[int],
              model_spec: str, params: SamplingParams,
              on_text: Callable[[str], None] | None, tracer: Tracer | None,
              speculative: SpeculativeConfig | None) -> dict[str, Any]:
    request = engine.add_request(prompt_token_ids, params)
    stream = StreamDecoder(tokenizer, skip_special_tokens=True) if tokenizer else None
    tracer = tracer or Tracer()
    while engine.has_unfinished():
        start = time.time()
        events = engine.step()
        if engine.last_batch is not None:
            tracer.complete("step", start, time.time(), num_tokens=engine.last_batch.num_tokens,
                            num_seqs=len(engine.last_batch.chunks))
        for event in events:
            if stream is not None and on_text is not None:
                on_text(stream.push(event.token_id))
    if stream is not None and on_text is not None:
        on_text(stream.flush())
    engine.allocator.check_invariants(expect_all_free=True)
    result: dict[str, Any] = {
        "model": model_spec,
        "prompt_token_ids": prompt_token_ids,
        "token_ids": request.output_token_ids,
        "finish_reason": request.state.value.removeprefix("finished_"),
    }
    if tokenizer is not None:
        result["text"] = tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
    if speculative is not None:
        result |= {"draft_tokens": request.num_draft_tokens,
                   "accepted_tokens": request.num_accepted_tokens, "steps": engine.num_steps}
    return result
