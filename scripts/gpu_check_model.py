"""GPU check, part 2: the engine's decode steps as captured CUDA graphs, counter inside (S3b).

A 1B-class random Llama runs the same decode batch three ways: eager, graph replay without a
layer counter, graph replay bumping a mapped pinned counter that a `CounterPoller` watches;
the graphed engine's KV cache is cuMem memory (`CacheConfig.memory`).
Checks: the static path's logits match eager, every replay's bumps reach the poller (num_layers
per step), and the step times side by side. Run by `gpu_check.py`.
"""

from __future__ import annotations

import time

import torch
from gpu_check_common import SEED, Row, synchronize

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.batch import Batch
from disagg.engine.llm_engine import EngineParts, LLMEngine
from disagg.engine.request import SamplingParams
from disagg.model.layer_counter import LayerCounter, NullLayerCounter
from disagg.model.transformer import Transformer

GPU_MODEL = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                        eos_token_ids=(0,), max_position_embeddings=4096, name="gpu-check-1b")
BATCH = 8
PROMPT_LEN = 200
STEPS = 100


def _engine(model: Transformer, cuda_graph: bool, device: str) -> LLMEngine:
    # The graphed engine's KV comes from cuMem (S5a): graphs must replay over it unchanged.
    memory = "cumem" if cuda_graph and device == "cuda" else "torch"
    cache = CacheConfig(page_size=16, num_pages=BATCH * 32 + 1, memory=memory)
    config = EngineConfig(model.config, cache, SchedulerConfig(max_num_seqs=BATCH),
                          device=device, cuda_graph=cuda_graph, graph_batch_sizes=(1, 2, 4, 8))
    return LLMEngine(EngineParts.build(config, model))


def _decode_batch(engine: LLMEngine) -> Batch:
    """Prefill BATCH prompts, then return the pure-decode batch of the next step."""
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(BATCH):
        prompt = torch.randint(1, engine.model.config.vocab_size, (PROMPT_LEN,),
                               generator=generator)
        engine.add_request(prompt.tolist(), SamplingParams(max_tokens=64, ignore_eos=True))
    while True:
        engine.step()
        batch = engine.last_batch
        if batch is not None and batch.is_pure_decode and len(batch.chunks) == BATCH:
            return batch


def _step_ms(engine: LLMEngine, batch: Batch, steps: int) -> float:
    """Mean time of `runner.execute(batch)`: fill the static inputs, replay (or run), outputs."""
    for _ in range(WARMUP):
        engine.runner.execute(batch)
    synchronize(engine.kv_cache.device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.runner.execute(batch)
    synchronize(engine.kv_cache.device)
    return (time.perf_counter() - started) * 1e3 / steps


WARMUP = 5


@torch.inference_mode()
def model_graph_check(device: str = "cuda", config: ModelConfig = GPU_MODEL,
                      steps: int = STEPS) -> list[Row]:
    """On CPU (a dry run of this script's logic) the static path runs eagerly."""
    from transfer_core.poller import CounterPoller

    torch.manual_seed(SEED)
    model = Transformer(config).to(device).eval()
    eager, graphed = _engine(model, False, device), _engine(model, True, device)
    batch = _decode_batch(graphed)
    # The same requests (same KV) through the eager path: both engines share the model, so
    # the eager engine gets its own cache filled by the same prompts.
    eager_batch = _decode_batch(eager)
    # The batch already ran, so its chunks no longer sample: compare every row's logits.
    eager_logits, graph_logits = (
        model.compute_logits(engine.runner.execute(b).all_hidden_states)
        for engine, b in ((eager, eager_batch), (graphed, batch)))
    diff = (eager_logits - graph_logits).abs().max().item()
    same_argmax = bool(torch.equal(eager_logits.argmax(-1), graph_logits.argmax(-1)))
    eager_ms = _step_ms(eager, eager_batch, steps)
    model.layer_counter = NullLayerCounter()
    plain_ms = _step_ms(graphed, batch, steps)
    counter = LayerCounter.for_device(device)
    model.layer_counter = counter  # the graphs are recaptured with the bump inside
    jumps: list[int] = []
    with CounterPoller([counter.poll_target], lambda _, old, new: jumps.append(new - old)
                       ) as poller:
        bumped_ms = _step_ms(graphed, batch, steps)
        poller.wait_for(0, counter.read(), timeout=30)
    expected, observed = (WARMUP + steps) * config.num_layers, sum(jumps)
    stats = graphed.runner.graph_stats
    model.layer_counter = NullLayerCounter()
    return [
        ("graph logits = eager", diff < 1e-2 and same_argmax, f"max |diff| {diff:.2e}",
         f"batch {BATCH}, context {PROMPT_LEN}, argmax equal: {same_argmax}, graphed KV "
         f"from {graphed.config.cache.memory}"),
        ("decode step eager", True, f"{eager_ms:.3f} ms", f"{config.name}, batch {BATCH}"),
        ("decode step graph", True, f"{plain_ms:.3f} ms", f"{eager_ms / plain_ms:.1f}x eager"),
        ("graph + counter", True, f"{bumped_ms:.3f} ms",
         f"+{(bumped_ms - plain_ms) * 1e3:.1f} us for {config.num_layers} bumps"),
        ("engine bumps observed", observed == expected, f"{observed}/{expected}",
         f"{len(jumps)} callbacks; runner stats {stats}"),
    ]  # fmt: skip
