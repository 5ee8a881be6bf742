"""GPU check, part 5: TP rank processes on CUDA: NCCL all-reduces, cuMem KV shards (S3c, S5a).

The engine at TP 2 (the leader and one rank process, each on its own GPU, the rank's KV a
cuMem allocation the leader imports) must decode the TP 1 tokens; the table gives both step
times. NCCL refuses two ranks on one GPU, so with fewer than two GPUs the row says it was
skipped and why. The dry run does the same on CPU (gloo, memfd KV). Run by `gpu_check.py`.
"""

from __future__ import annotations

import time

import torch
from gpu_check_common import Row

from disagg.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [42, 43, 44], list(range(3, 40))]


def _tokens(device: str, tp: int) -> tuple[list[list[int]], float]:
    loaded = load_model("tiny")
    config = EngineConfig(loaded.config, CacheConfig(page_size=4, num_pages=64, kv_layout="HND"),
                          SchedulerConfig(chunk_size=16, max_num_batched_tokens=16),
                          ParallelConfig(tp), device=device)
    engine = build_engine(config, loaded.state_dict, model_spec="tiny")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        engine.generate(PROMPTS, params)  # warm-up: first-step allocations, NCCL setup
        started, steps = time.perf_counter(), engine.num_steps
        requests = engine.generate(PROMPTS, params)
        ms_per_step = (time.perf_counter() - started) * 1e3 / max(1, engine.num_steps - steps)
        return [r.output_token_ids for r in requests], ms_per_step
    finally:
        engine.close()


def tp_check(device: str = "cuda", tp: int = 2) -> list[Row]:
    """TP `tp` rank processes on `device` decode TP 1's tokens."""
    if device == "cuda" and torch.cuda.device_count() < tp:
        return [("tp_ranks", True, "skipped", f"needs {tp} GPUs, this machine has "
                 f"{torch.cuda.device_count()} (NCCL refuses two ranks on one GPU)")]
    one, one_ms = _tokens(device, 1)
    many, many_ms = _tokens(device, tp)
    backend = "NCCL, cuMem KV" if device == "cuda" else "gloo, memfd KV"
    return [("tp_ranks", one == many, f"{many_ms:.1f} ms/step",
             f"TP {tp} ({backend}) tokens {'equal' if one == many else 'DIFFER from'} TP 1 "
             f"({one_ms:.1f} ms/step)")]
