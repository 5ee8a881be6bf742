"""Step 13: a decode step is a stream of weight bytes, and the engine's CPU kernels (X8).

One engine, a SmolLM2-shaped model of 8 layers with random weights: a prompt, then decode steps
with the step's layers in one C call (X8e) and in the PyTorch loop, taking turns; the same
greedy tokens from both, each step's median time, and the step's floor: the bytes of weights
it reads over the memory's read rate, measured here. Pairs with
docs/tutorials/13-the-engine-at-the-machines-speed.md.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from disagg import CacheConfig, EngineConfig, SamplingParams, build_engine
from disagg.engine.llm_engine import LLMEngine
from disagg.model import decode_layers
from disagg.model.loading.registry import init_random_weights
from disagg.model_config import ModelConfig

# SmolLM2-135M's layer (GQA 9/3 heads of 64, SwiGLU of 1,536), 8 of its 30 layers.
CONFIG = ModelConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_layers=8,
                     num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                     eos_token_ids=(0,), name="smollm2-shaped-8")
PROMPT = list(range(1, 129))
STEPS = 12


def read_rate_gbs(megabytes: int = 256) -> float:
    """GB/s of `torch.sum` over a buffer far larger than the caches (the best of 3)."""
    buffer = torch.ones(megabytes << 18)  # float32: 4 bytes each
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(3))
    return buffer.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode(engine: LLMEngine, in_c: bool) -> tuple[list[int], float]:
    """A request's greedy tokens and its decode steps' median seconds."""
    decode_layers.ENABLED = in_c and decode_layers.AVX512
    request = engine.add_request(PROMPT, SamplingParams(max_tokens=STEPS + 1, ignore_eos=True))
    engine.step()  # the prefill, and the first token
    steps = [_timed(engine.step) for _ in range(STEPS)]
    assert not engine.has_unfinished()
    return request.output_token_ids, statistics.median(steps)


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    engine = build_engine(EngineConfig(CONFIG, CacheConfig(page_size=16, num_pages=64)),
                          init_random_weights(CONFIG))
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    print(f"{CONFIG.name}: {weights / 1e6:.0f} MB of float32 weights, read once per decode step")
    if not decode_layers.AVX512:
        print("no AVX-512 here (or the kernels are not built): both runs below are the loop")
    decode(engine, True)  # warm: the first decode builds the call's table of weights
    runs = {True: [], False: []}
    for turn in range(4):
        in_c = turn % 2 == 0
        tokens, seconds = decode(engine, in_c)
        runs[in_c].append((tokens, seconds))
    decode_layers.ENABLED = decode_layers.AVX512
    assert runs[True][0][0] == runs[False][0][0], "the call and the loop decode alike"
    rate = read_rate_gbs()
    floor_ms = weights / rate / 1e6
    for in_c, name in ((True, "layers in one C call"), (False, "the PyTorch loop")):
        ms = statistics.median(seconds for _, seconds in runs[in_c]) * 1e3
        print(f"  {name:22} {ms:6.1f} ms a step, {floor_ms / ms:.2f} of the floor")
    print(f"floor: {weights / 1e6:.0f} MB at {rate:.1f} GB/s = {floor_ms:.1f} ms; "
          f"tokens {runs[True][0][0][:6]}... the same from both")


if __name__ == "__main__":
    main()
