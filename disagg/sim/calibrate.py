"""Measure this machine's `cpu` preset, then test the cost model on steps it was not fitted to.

Calibration: microbenchmarks give the GEMM rate (a hot matmul), the peak weight-streaming
bandwidth (a GEMV over 256 MiB) and attention efficiency (SDPA against that GEMM rate); the
random-init `tiny` shape with 2 and 8 layers, where every millisecond is overhead, gives the
engine's fixed costs; one SmolLM2-135M decode step (batch 1) gives the share of the streaming
peak our engine reaches on its few-MB weight matrices. Validation then times other
`LLMEngine.step()` shapes (prefills, larger decode batches, a mixed step) against predictions.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F

from disagg.config import PRESETS as ENGINE_PRESETS
from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import LoadedModel, init_random_weights, load_model
from disagg.sim.cost_model import BatchShape, Parallel, step_time
from disagg.sim.hardware import Hardware
from disagg.sim.models import from_model_config

logger = logging.getLogger(__name__)
ONE_RANK = Parallel(tp=1)
CALIBRATION_STEP = ("decode 1 x ctx 128", 1, 128)  # (name, batch, context) fixing memory use


def busy_share(seconds: float = 1.0) -> float:
    """Share of this machine's CPU time that went to work (anyone's) over `seconds`."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all jiffies, idle + iowait
    total0, idle0 = read()
    time.sleep(seconds)
    total1, idle1 = read()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_quiet(max_wait_s: float, threshold: float = 0.3) -> bool:
    """Wait (up to `max_wait_s`) until under `threshold` of the CPU is busy; True if it was.

    With `max_wait_s <= 0` it returns False at once, without looking.
    """
    if max_wait_s <= 0:
        return False
    deadline = time.monotonic() + max_wait_s
    while True:
        if busy_share(0.5) < threshold:
            return True
        if time.monotonic() > deadline:
            return False


def _fastest(fn: Callable[[], object], reps: int) -> float:
    """Seconds of the fastest of `reps` calls: the run other processes disturbed least."""
    fn()  # warm caches and lazy initialisation
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure_rates(reps: int = 10) -> dict[str, float]:
    """GEMM FLOP/s, streaming GEMV bytes/s and SDPA FLOP/s of this CPU (fp32)."""
    generator = torch.Generator().manual_seed(0)
    a, w = torch.randn(512, 1024, generator=generator), torch.randn(2048, 1024, generator=generator)
    gemm = 2 * 512 * 1024 * 2048 / _fastest(lambda: F.linear(a, w), reps)
    # 256 MiB of weights: far past any cache, so each GEMV streams them from DRAM.
    big, x = torch.randn(65536, 1024, generator=generator), torch.randn(1, 1024)
    bandwidth = big.numel() * 4 / _fastest(lambda: F.linear(x, big), reps)
    q = torch.randn(1, 8, 512, 64, generator=generator)
    sdpa_flops = 2 * 8 * 64 * 2 * (512 * 513 / 2)  # QK^T and PV over causal pairs
    sdpa = sdpa_flops / _fastest(
        lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), reps)
    return {"gemm_flops": gemm, "bandwidth": bandwidth, "attention_flops": sdpa}


def _engine(config: ModelConfig, state: dict[str, torch.Tensor], num_pages: int = 1024,
            budget: int = 4096) -> LLMEngine:
    engine_config = EngineConfig(config, CacheConfig(page_size=16, num_pages=num_pages),
                                 SchedulerConfig(max_num_seqs=256, chunk_size=budget,
                                                 max_num_batched_tokens=budget))
    return build_engine(engine_config, state)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def time_prefill(make: Callable[[], LLMEngine], num_seqs: int, prompt_len: int,
                 reps: int) -> float:
    """Fastest seconds of one step that prefills `num_seqs` fresh prompts together."""
    engine = make()
    params = SamplingParams(max_tokens=1, ignore_eos=True)  # done (pages freed) after the step
    samples = []
    for rep in range(reps + 1):
        for i in range(num_seqs):
            engine.add_request(_prompt(prompt_len, engine.model.config.vocab_size, rep * 97 + i),
                               params)
        start = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - start)
    return min(samples[1:])


def time_decode(make: Callable[[], LLMEngine], batch: int, prompt_len: int, reps: int,
                mixed_prompt: int = 0) -> float:
    """Fastest seconds of a step with `batch` decodes (plus one `mixed_prompt` chunk if > 0)."""
    engine = make()
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(_prompt(prompt_len, vocab, i), params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    samples = []
    for rep in range(reps + 1):
        if mixed_prompt:
            engine.add_request(_prompt(mixed_prompt, vocab, 1000 + rep),
                               SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - start)
    return min(samples[1:])


def _tiny(num_layers: int) -> Callable[[], LLMEngine]:
    config = replace(ENGINE_PRESETS["tiny"], num_layers=num_layers, name=f"tiny-{num_layers}")
    state = init_random_weights(config)
    return lambda: _engine(config, state)


def time_overhead_steps(reps: int) -> dict[str, float]:
    """Raw step times of the `tiny` shape (2 and 8 layers), where every ms is overhead."""
    two, eight = _tiny(2), _tiny(8)
    return {"decode2": time_decode(two, 1, 16, reps), "decode8": time_decode(eight, 1, 16, reps),
            "decode2_16seqs": time_decode(two, 16, 16, reps),
            "prefill2_1seq": time_prefill(two, 1, 16, reps),
            "prefill2_8seqs": time_prefill(two, 8, 16, reps)}


def overheads(raw: dict[str, float]) -> dict[str, float]:
    """Per-step, per-layer and per-sequence costs from `time_overhead_steps`' timings."""
    per_layer = max(0.0, (raw["decode8"] - raw["decode2"]) / 6)
    per_seq = max(0.0, (raw["decode2_16seqs"] - raw["decode2"]) / 15)
    loop = (raw["prefill2_8seqs"] - raw["prefill2_1seq"]) / 7  # a prompt in the Python loop
    return {"step": max(0.0, raw["decode2"] - 2 * per_layer), "layer": per_layer,
            "seq": per_seq, "seq_layer": max(0.0, (loop - per_seq) / 2)}


@cache
def _load(model_name: str) -> LoadedModel:
    return load_model(model_name)


def _make(loaded: LoadedModel) -> Callable[[], LLMEngine]:
    return lambda: _engine(loaded.config, loaded.state_dict)


def memory_efficiency(hw: Hardware, model_name: str, measured_s: float) -> float:
    """Share of the streaming peak that the calibration step reached in `measured_s`: invert
    the cost model for that step (compute and fixed costs predicted, the rest is streaming)."""
    model = from_model_config(_load(model_name).config, weight_bytes=4, kv_bytes=4)
    _, batch, context = CALIBRATION_STEP
    shape = BatchShape.from_chunks([(1, context)] * batch)
    peak = replace(hw, memory_efficiency=1.0)
    no_memory = step_time(model, replace(peak, hbm_bandwidth=1e30), ONE_RANK, shape)
    streaming = step_time(model, peak, ONE_RANK, shape) - no_memory
    return min(1.0, max(0.05, streaming / max(measured_s - no_memory, 1e-9)))


def calibrate_cpu(threads: int = 1, reps: int = 10, rounds: int = 3,
                  model_name: str = "smollm2-135m", quiet_wait_s: float = 0.0) -> Hardware:
    """Measure with `threads` torch threads and return the `cpu` preset.

    Every timing is repeated for `rounds` rounds, interleaved, and the best kept: on a shared
    machine a busy stretch then spoils one round, not the calibration.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rates: dict[str, float] = {}
    raw: dict[str, float] = {}
    decode_s = float("inf")
    _, batch, context = CALIBRATION_STEP
    try:
        for _ in range(rounds):
            wait_for_quiet(quiet_wait_s)
            rates = {k: max(v, rates.get(k, 0.0)) for k, v in measure_rates(reps).items()}
            raw = {k: min(v, raw.get(k, v)) for k, v in time_overhead_steps(reps).items()}
            decode_s = min(decode_s, time_decode(_make(_load(model_name)), batch, context, reps))
    finally:
        torch.set_num_threads(previous)
    hw = _cpu_hardware(threads, rates, overheads(raw))
    hw = replace(hw, memory_efficiency=memory_efficiency(hw, model_name, decode_s))
    logger.info("cpu calibration: %s %s memory efficiency %.2f", rates, overheads(raw),
                hw.memory_efficiency)
    return hw


def _cpu_hardware(threads: int, rates: dict[str, float], fixed: dict[str, float]) -> Hardware:
    kernels = from_model_config(ENGINE_PRESETS["tiny"]).kernels_per_layer
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    # One CPU thread issues loads and FMAs from one instruction stream and oneDNN does not
    # prefetch the next weight panel while computing this one at these sizes: the two add.
    # Our attention (disagg/model/attention.py) moves each KV byte five times: index_select reads
    # the pages and writes a copy, the reshape of the permuted view copies it again, and
    # SDPA reads that copy; paged GPU kernels read it once, in place.
    return Hardware(
        name=f"cpu-{threads}t", devices_per_node=1, bf16_flops=rates["gemm_flops"],
        fp8_flops=rates["gemm_flops"], hbm_bandwidth=rates["bandwidth"], hbm_capacity=memory,
        nvlink_bandwidth=rates["bandwidth"], nic_bandwidth=rates["bandwidth"] / 2,
        nics_per_node=1, nic_latency_s=50e-6, gemm_efficiency=1.0,
        attention_efficiency=min(1.0, rates["attention_flops"] / rates["gemm_flops"]),
        memory_efficiency=1.0, comm_efficiency=1.0, collective_latency_s=0.0,
        kernel_overhead_s=fixed["layer"] / kernels, step_overhead_s=fixed["step"],
        seq_overhead_s=fixed["seq"], seq_layer_overhead_s=fixed["seq_layer"],
        overlap_compute_memory=False, kv_read_passes=5.0)


@dataclass(frozen=True, slots=True)
class StepCheck:
    """One validation case: the step, what the cost model predicted, what the engine took."""

    case: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction (+0.1: predicted 10% too slow)."""
        return self.predicted_s / self.measured_s - 1


def validate_steps(hw: Hardware, model_name: str = "smollm2-135m", threads: int = 1,
                   rounds: int = 3, quiet_wait_s: float = 0.0) -> list[StepCheck]:
    """Time SmolLM2-135M steps with our engine and compare each with the cost model.

    Cases are measured round-robin for `rounds` rounds and each keeps its fastest time, so
    one busy stretch of a shared machine spoils one sample of each case, not a whole case.
    """
    loaded = _load(model_name)
    model = from_model_config(loaded.config, weight_bytes=4, kv_bytes=4)
    make, reps = _make(loaded), 2
    cases: list[tuple[str, BatchShape, Callable[[], float]]] = [
        ("prefill 1x128", BatchShape.from_chunks([(128, 0)]),
         lambda: time_prefill(make, 1, 128, reps)),
        ("prefill 1x384", BatchShape.from_chunks([(384, 0)]),
         lambda: time_prefill(make, 1, 384, reps)),
        ("prefill 4x64", BatchShape.from_chunks([(64, 0)] * 4),
         lambda: time_prefill(make, 4, 64, reps)),
    ]
    for batch in (1, 4, 16):
        name = f"decode {batch} x ctx 128"
        name += " (calibration step)" if name == CALIBRATION_STEP[0] else ""
        cases.append((name, BatchShape.from_chunks([(1, 128)] * batch),
                      lambda b=batch: time_decode(make, b, 128, 2 * reps)))
    cases.append(("mixed 8 decodes + 256 chunk",
                  BatchShape.from_chunks([(1, 130)] * 8 + [(256, 0)]),
                  lambda: time_decode(make, 8, 128, reps, mixed_prompt=256)))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fastest = [float("inf")] * len(cases)
        for _ in range(rounds):
            for i, (_, _, measure) in enumerate(cases):
                wait_for_quiet(quiet_wait_s)  # other processes on the machine skew timings
                fastest[i] = min(fastest[i], measure())
    finally:
        torch.set_num_threads(previous)
    return [StepCheck(name, step_time(model, hw, ONE_RANK, shape), measured)
            for (name, shape, _), measured in zip(cases, fastest, strict=True)]
