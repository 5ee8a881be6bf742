"""Step 2: the scheduler, and why a batch holding a prefill chunk stalls its decodes (S1, S3a).

Four requests decode on the `small` model (random weights, CPU). Then a 1,000-token prompt
arrives: the scheduler cuts it into chunks that share each step with the four decodes. We time
every step of our engine and compare pure-decode steps with mixed ones, for two chunk sizes.
Pairs with docs/tutorials/02-scheduler-and-mixed-stalls.md.
"""

from __future__ import annotations

import statistics
import time

import torch

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.batch import Batch
from disagg.engine.llm_engine import EngineParts, LLMEngine
from disagg.engine.request import SamplingParams
from disagg.model.transformer import Transformer


def describe(batch: Batch) -> str:
    """What one step holds, e.g. 'decode x4 + req-4 [0:252)'."""
    decodes = sum(chunk.is_decode for chunk in batch.chunks)
    chunks = [c for c in batch.chunks if not c.is_decode]
    parts = [f"decode x{decodes}"] if decodes else []
    if len(chunks) > 2:
        parts.append(f"{len(chunks)} prompts [0:{chunks[0].end})")
    else:
        parts += [f"{c.request.request_id} [{c.start}:{c.end})" for c in chunks]
    return " + ".join(parts)


def run(chunk_size: int, show_steps: bool) -> tuple[list[float], list[float]]:
    """Serve 4 short requests, add a long one mid-way; returns (pure-decode ms, mixed ms)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("small"))  # 4 layers, hidden 256, random init
    config = EngineConfig(model.config, CacheConfig(page_size=16, num_pages=256),
                          SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=256))
    engine = LLMEngine(EngineParts.build(config, model))
    prompts = torch.randint(3, model.config.vocab_size, (5, 1000)).tolist()
    for prompt in prompts[:4]:
        engine.add_request(prompt[:32], SamplingParams(max_tokens=40))
    pure, mixed = [], []
    step = 0
    while engine.has_unfinished():
        step += 1
        if step == 6:  # a long prompt arrives while the four decode
            engine.add_request(prompts[4], SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - start) * 1e3
        batch = engine.last_batch
        assert batch is not None
        decodes = sum(chunk.is_decode for chunk in batch.chunks)
        if step > 2 and decodes == 4:  # skip the first steps: one-off warm-up costs
            (pure if batch.is_pure_decode else mixed).append(ms)
        if show_steps and step <= 12:
            print(f"{step:>4}  {describe(batch):<30} {batch.num_tokens:>6} {ms:>7.1f}")
    return pure, mixed


def main() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, like one GPU: steady timings on a busy laptop
    try:
        print("step  batch                          tokens      ms")
        results = {256: run(chunk_size=256, show_steps=True), 64: run(64, show_steps=False)}
    finally:
        torch.set_num_threads(threads)
    print("\nchunk  pure-decode step  mixed step  slowdown  mixed steps  prompt done after")
    for chunk_size, (pure, mixed) in results.items():
        p, m = statistics.median(pure), statistics.median(mixed)
        print(f"{chunk_size:>5}  {p:>13.1f} ms  {m:>7.1f} ms  {m / p:>7.1f}x  {len(mixed):>11}"
              f"  {sum(mixed):>13.0f} ms")


if __name__ == "__main__":
    main()
