"""Single-node engine speed against Hugging Face transformers, side by side (S1, S9b, X8).

For each model (SmolLM2-135M and a random Qwen3-MoE by default) and each dtype (float32 and
bfloat16), both sides load the same Hugging Face checkpoint (`engine_models.py`) and run in that
dtype on the same threads: prefill tokens/s of one prompt at each `--prompt-lens` length (ours in
one chunk), and the time of one decode step at each `--batches` size after prompts of the first
length, for our paged engine in both KV layouts and for transformers' own KV-cached forward. The
three engines take turns within every rep (median of `--reps`), so a busy spell on the machine
hits all of them. Every row pairs ours with transformers: `ratio` is transformers / ours,
`ours_speedup` says how many times faster ours is whatever the unit.

The machine's speed (X8): the run measures the memory's read bandwidth (`read_bandwidth_gbs`),
and a decode step at batch 1 is set against its roofline, the time to read the weights it uses
(`decode_weight_bytes`) and its prompt's KV at that bandwidth: `roofline_fraction_batch1` is
roofline / measured, 1 being the machine's speed, taken rep by rep (each rep's step against
the bandwidth sampled just before it) and then the median over reps. glibc's malloc runs with
the serving nodes' settings (`keep_freed_memory`) unless `--malloc-defaults`, for both engines
alike.
Run: `python benchmarks/engine.py [--models smollm2-135m qwen3-moe-small] [--dtype bfloat16]`.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from engine_models import (
    ATTENTION_IMPLEMENTATION,
    EXPERTS_IMPLEMENTATION,
    load_reference,
    our_engine,
    write_checkpoint,
)
from roofline import (
    BANDWIDTH_BUFFER_BYTES,
    decode_weight_bytes,
    kv_bytes,
    read_bandwidth_gbs,
    roofline_ms,
)
from result_output import emit

from disagg.config import DTYPES, check_dtype
from disagg.engine.llm_engine import LLMEngine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import LoadedModel, load_model
from disagg.node.builder import keep_freed_memory

LAYOUTS = ("NHD", "HND")
ROOFLINE = "roofline_fraction_batch1"
Case = tuple[str, int]  # ("prefill", prompt length) or ("decode", batch)
Metrics = dict[str, tuple[bool, str]]


def metrics_of(prompt_lens: list[int], batches: list[int]) -> Metrics:
    """Each metric, whether a higher value is the faster engine, and its table heading."""
    metrics = {f"prefill_tokens_per_s_{n}": (True, f"prefill tok/s, {n}") for n in prompt_lens}
    metrics |= {f"decode_step_ms_batch{b}": (False, f"decode ms, batch {b}") for b in batches}
    if 1 in batches:
        metrics[ROOFLINE] = (True, "roofline share, b1")
    return metrics


def _cpu_jiffies() -> tuple[int, int]:
    """(all, busy) jiffies of every CPU since boot; busy leaves out idle and iowait."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return sum(fields), sum(fields) - fields[3] - fields[4]


class CpuMeter:
    """The share of the machine's CPU time that other processes took since this meter was made:
    what skewed the timings (this process's own threads are subtracted)."""

    def __init__(self) -> None:
        self._jiffies, self._own = _cpu_jiffies(), self._own_cpu_s()

    @staticmethod
    def _own_cpu_s() -> float:
        times = os.times()
        return times.user + times.system

    def others_share(self) -> float:
        total, busy = (now - then for now, then in zip(_cpu_jiffies(), self._jiffies, strict=True))
        own = (self._own_cpu_s() - self._own) * os.sysconf("SC_CLK_TCK")
        return max(0.0, (busy - own) / max(total, 1))


def wait_for_quiet(max_wait_s: float = 30.0, busy_limit: float = 0.15) -> tuple[bool, float]:
    """Wait until the machine is mostly idle (other processes skew CPU timings); returns
    whether it got there and the busy share of the last second measured."""
    deadline = time.monotonic() + max_wait_s
    while True:
        meter = CpuMeter()
        time.sleep(1.0)
        busy = meter.others_share()
        if busy < busy_limit or time.monotonic() >= deadline:
            return busy < busy_limit, busy


def warm_prefill_engine(loaded: LoadedModel, kv_layout: str, dtype: torch.dtype,
                        prompt: list[int]) -> LLMEngine:
    """Our paged engine in `dtype` (weights, activations and KV) for prefills of `prompt`'s
    length, warmed by one untimed prefill of it: a serving engine lives long, its cache and scratch
    buffers already touched (a fresh one pays a page fault per 4 KiB of them on its first
    prefill), as transformers' model is loaded once. No prefix cache, so every prefill
    computes its whole prompt."""
    engine = our_engine(loaded, kv_layout, dtype, len(prompt), 1, 1, prefix_caching=False)
    assert engine.model.embed_tokens.weight.dtype == dtype, "our engine runs in another dtype"
    ours_prefill(engine, prompt)
    return engine


def ours_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds `engine` takes to prefill `prompt`: the whole prompt in one chunk, its first
    token sampled (the request then ends and frees its pages)."""
    start = time.perf_counter()
    request = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    seconds = time.perf_counter() - start
    # A token is sampled only once the whole prompt is in: one step, so one chunk.
    assert len(request.output_token_ids) == 1, "the prompt took more than one chunk"
    return seconds


def ours_decode(loaded: LoadedModel, kv_layout: str, dtype: torch.dtype, prompt: list[int],
                batch: int, steps: int) -> float:
    """The median seconds of our decode step with `batch` requests of `prompt` running."""
    # Each request decodes while the later ones are added (one a step), then `steps` timed:
    # none may finish before the timing ends, or the batch would shrink under it.
    decodes = steps + batch
    # No prefix cache: every request holds its own copy of the prompt's KV, as transformers'
    # batch does; shared pages would let our attention read one copy `batch` times.
    engine = our_engine(loaded, kv_layout, dtype, len(prompt), batch, decodes,
                        prefix_caching=False)
    params = SamplingParams(max_tokens=decodes + 1, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(prompt, params)
        engine.step()
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    return statistics.median(step_times)


def reference_prefill(hf_model: torch.nn.Module, prompt: list[int]) -> float:
    """Seconds transformers' forward takes over `prompt`, computing the last position's logits
    only (`logits_to_keep=1`, as its `generate` does, and ours)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_model(ids, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1)
        return time.perf_counter() - start


def _cache_argument(hf_model: torch.nn.Module) -> str:
    """The forward's name for the KV cache: `cache` since transformers 5.2x, which warns
    that `past_key_values` goes away; older releases know only `past_key_values`."""
    names = inspect.signature(hf_model.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def _cache_of(out: Any) -> Any:
    """The KV cache a forward returned, under either release's name."""
    return out["cache"] if "cache" in out else out.past_key_values


def reference_decode(hf_model: torch.nn.Module, prompt: list[int], batch: int,
                     steps: int) -> float:
    """The median seconds of transformers' decode step with DynamicCache, `batch` rows of
    `prompt`."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        cache, next_ids = _cache_of(out), out.logits[:, -1:].argmax(-1)
        # Copies of one prompt's KV: what a batched prefill of the same rows would store,
        # without its cost, which grows with the batch.
        cache.batch_repeat_interleave(batch)
        next_ids = next_ids.repeat(batch, 1)
        cache_argument = _cache_argument(hf_model)  # not in the timed steps
        step_times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = hf_model(next_ids, use_cache=True, **{cache_argument: cache})
            next_ids = out.logits[:, -1:].argmax(-1)
            step_times.append(time.perf_counter() - start)
            cache = _cache_of(out)
    return statistics.median(step_times)


def cases_of(prompt_lens: list[int], batches: list[int]) -> list[Case]:
    return [("prefill", n) for n in prompt_lens] + [("decode", b) for b in batches]


def measure(directory: Path, loaded: LoadedModel, dtype: torch.dtype,
            prompts: dict[int, list[int]], batches: list[int], steps: int,
            reps: int, bandwidth: Callable[[], float] | None = None
            ) -> tuple[dict[str, dict[Case, list[float]]], list[float]]:
    """Seconds by engine ("ours-NHD", "ours-HND", "transformers") and case: a prefill by prompt
    length, a decode step by batch (after the first prompt), the engines taking turns in every
    rep (in a rotated order, so that none always runs first). `loaded` is our float32 load of
    `directory`; each engine casts its own copy to `dtype`. Also the read bandwidth,
    sampled with `bandwidth` just before each rep's batch-1 decodes: on a shared host it
    drifts by half between minutes, so a roofline from another moment would mislead."""
    hf_model = load_reference(directory, dtype)
    assert hf_model.dtype == dtype, f"transformers loaded {hf_model.dtype}, not {dtype}"
    decode_prompt = next(iter(prompts.values()))  # the first length's
    for prompt in prompts.values():  # both sides warm before any timing
        reference_prefill(hf_model, prompt)
    prefill_engines = {(layout, size): warm_prefill_engine(loaded, layout, dtype, prompt)
                       for layout in LAYOUTS for size, prompt in prompts.items()}

    def run(name: str, case: Case) -> float:
        kind, size = case
        if name == "transformers":
            return (reference_prefill(hf_model, prompts[size]) if kind == "prefill"
                    else reference_decode(hf_model, decode_prompt, size, steps))
        layout = name.removeprefix("ours-")
        return (ours_prefill(prefill_engines[layout, size], prompts[size]) if kind == "prefill"
                else ours_decode(loaded, layout, dtype, decode_prompt, size, steps))

    names = [*(f"ours-{layout}" for layout in LAYOUTS), "transformers"]
    cases = cases_of(list(prompts), batches)
    samples: dict[str, dict[Case, list[float]]] = {name: {c: [] for c in cases} for name in names}
    bandwidths: list[float] = []
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for case in cases:
            if case == ("decode", 1) and bandwidth is not None:
                bandwidths.append(bandwidth())
            for name in order:
                samples[name][case].append(run(name, case))
    return samples, bandwidths


def summarize(samples: dict[Case, list[float]]) -> dict[str, float]:
    """One engine's metrics: medians over reps."""
    out = {}
    for (kind, size), seconds in samples.items():
        median = statistics.median(seconds)
        if kind == "prefill":
            out[f"prefill_tokens_per_s_{size}"] = size / median
        else:
            out[f"decode_step_ms_batch{size}"] = median * 1e3
    return out


def shares_by_rep(steps_s: list[float], roofline: dict[str, Any]) -> list[float]:
    """Each rep's batch-1 step against the roofline at the bandwidth sampled just before that
    rep's decodes: the host's bandwidth drifts by half between minutes, and a step set against
    another minute's sample read above 1 (a faster minute than the median's)."""
    return [roofline_ms(roofline["weight_bytes"], roofline["kv_bytes"], gbs) / (step * 1e3)
            for step, gbs in zip(steps_s, roofline["gbs_by_rep"], strict=True)]


def with_roofline(metrics: dict[str, float], steps_s: list[float],
                  roofline: dict[str, Any] | None) -> dict[str, float]:
    """`metrics` and, given the roofline, the median over reps of each rep's share of it."""
    if roofline is None:
        return metrics
    return {**metrics, ROOFLINE: statistics.median(shares_by_rep(steps_s, roofline))}


def rows_of(model: str, dtype: str, samples: dict[str, dict[Case, list[float]]],
            metrics: Metrics, roofline: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per (layout, metric): ours beside transformers, measured in the same reps. A
    roofline row also holds the roofline's ms at the median bandwidth, the bytes it reads and
    the bandwidth of each rep (`roofline`), and each engine's batch-1 step per rep."""
    decode1 = ("decode", 1)

    def steps(name: str) -> list[float]:
        return samples[name].get(decode1, [])

    theirs = with_roofline(summarize(samples["transformers"]), steps("transformers"), roofline)
    rows = []
    for layout in LAYOUTS:
        mine = with_roofline(summarize(samples[f"ours-{layout}"]), steps(f"ours-{layout}"),
                             roofline)
        for metric, (higher_is_faster, _) in metrics.items():
            ratio = theirs[metric] / mine[metric]
            rows.append({"model": model, "dtype": dtype, "layout": layout, "metric": metric,
                         "ours": mine[metric], "transformers": theirs[metric], "ratio": ratio,
                         "ours_speedup": 1 / ratio if higher_is_faster else ratio,
                         **({**roofline, "steps_ms_by_rep": {
                             "ours": [s * 1e3 for s in steps(f"ours-{layout}")],
                             "transformers": [s * 1e3 for s in steps("transformers")]}}
                            if metric == ROOFLINE and roofline else {})})
    return rows


def roofline_of(loaded: LoadedModel, dtype: torch.dtype, context: int,
                bandwidths_gbs: list[float]) -> dict[str, Any]:
    """The batch-1 decode step's roofline for our model in `dtype` after `context` tokens: its
    ms at the median of the reps' bandwidths (the table's caption), and each rep's bandwidth,
    which that rep's share uses."""
    weights = decode_weight_bytes(our_engine(loaded, LAYOUTS[0], dtype, 1, 1, 1).model)
    kv = kv_bytes(loaded.config, context, dtype)
    return {"roofline_ms_batch1": roofline_ms(weights, kv, statistics.median(bandwidths_gbs)),
            "weight_bytes": weights, "kv_bytes": kv, "gbs_by_rep": bandwidths_gbs}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-moe-small"],
                        help="smollm2-135m, a Llama preset, qwen3-moe-small or qwen3-moe-tiny")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=list(DTYPES))
    parser.add_argument("--prompt-lens", "--prompt-len", dest="prompt_lens", nargs="+",
                        type=positive_int, default=[512, 2048],
                        help="prefill lengths; decode steps follow prompts of the first")
    parser.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8, 32],
                        help="decode batch sizes; the roofline needs 1")
    parser.add_argument("--steps", type=positive_int, default=16)
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--quiet-wait-s", type=float, default=30.0)
    parser.add_argument("--bandwidth-mib", type=positive_int,
                        default=BANDWIDTH_BUFFER_BYTES >> 20,
                        help="the read-bandwidth buffer (keep it far above the caches)")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="leave glibc malloc's thresholds as they are (the nodes raise them)")
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    for option, values in (("--prompt-lens", args.prompt_lens), ("--batches", args.batches)):
        if len(set(values)) != len(values):
            parser.error(f"{option} repeats a value: {values}")
    return args


def prompts_of(vocab_size: int, lengths: list[int]) -> dict[int, list[int]]:
    """A random prompt per length, each the start of the longest (the same tokens for all)."""
    tokens = torch.randint(10, vocab_size, (max(lengths),),
                           generator=torch.Generator().manual_seed(0)).tolist()
    return {n: tokens[:n] for n in lengths}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.malloc_defaults:
        keep_freed_memory()  # as every serving node does; process-wide, so both engines alike
    torch.set_num_threads(args.threads)
    started, rows = time.monotonic(), []
    quiet, busy_before = wait_for_quiet(args.quiet_wait_s)
    meter = CpuMeter()
    readers: list[str] = []  # which reader reached each sample

    def bandwidth() -> float:
        gbs, reader = read_bandwidth_gbs(args.bandwidth_mib << 20, repeats=3)
        readers.append(reader)
        return gbs

    bandwidths: dict[str, list[float]] = {}
    metrics = metrics_of(args.prompt_lens, args.batches)
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="engine-bench-") as directory:
            write_checkpoint(model, Path(directory))
            loaded = load_model(directory)  # once per model, float32
            prompts = prompts_of(loaded.config.vocab_size, args.prompt_lens)
            for dtype in args.dtype:
                samples, gbs = measure(Path(directory), loaded, check_dtype(dtype), prompts,
                                       args.batches, args.steps, args.reps, bandwidth)
                bandwidths[f"{model} {dtype}"] = gbs
                roofline = (roofline_of(loaded, check_dtype(dtype), args.prompt_lens[0], gbs)
                            if gbs else None)
                rows += rows_of(model, dtype, samples, metrics, roofline)
    import transformers

    samples = [gbs for run in bandwidths.values() for gbs in run]
    result = {"prompt_lens": args.prompt_lens, "decode_prompt_len": args.prompt_lens[0],
              "batches": args.batches, "steps": args.steps, "reps": args.reps,
              "threads": args.threads, "torch": torch.__version__,
              "transformers": transformers.__version__,
              "transformers_kernels": {"attention": ATTENTION_IMPLEMENTATION,
                                       "experts": EXPERTS_IMPLEMENTATION},
              "malloc": "glibc defaults" if args.malloc_defaults else "node settings",
              "read_bandwidth": {"gbs": statistics.median(samples) if samples else None,
                                 "gbs_by_run": bandwidths,
                                 "reader": max(set(readers), key=readers.count)
                                 if readers else None,
                                 "buffer_mib": args.bandwidth_mib},
              "quiet_machine": quiet, "others_cpu_share_before": busy_before,
              "others_cpu_share_during": meter.others_share(),
              "wall_s": time.monotonic() - started, "rows": rows}
    emit(args, result, print_table)
    return result


def number(value: float) -> str:
    """Three significant digits, but whole numbers from 100 up (2,516 tok/s, not 2.52e+03)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    metrics = metrics_of(result["prompt_lens"], result["batches"])
    busy, read = result["others_cpu_share_during"], result["read_bandwidth"]
    rooflines = [f"{r['model']} {r['dtype']} {r['roofline_ms_batch1']:.3g} ms at "
                 f"{statistics.median(read['gbs_by_run'][r['model'] + ' ' + r['dtype']]):.1f}"
                 for r in result["rows"] if r["metric"] == ROOFLINE and r["layout"] == LAYOUTS[0]]
    table = Table(title=f"ours vs transformers {result['transformers']}, {result['threads']} "
                        f"threads, median of {result['reps']}, decodes after "
                        f"{result['decode_prompt_len']} tokens, malloc {result['malloc']}; "
                        f"other processes took {busy:.0%} of the CPU",
                  caption=(f"roofline: weights and KV read at the GB/s ({read['reader']}) "
                           "sampled before each rep's batch-1 decodes, median: "
                           + "; ".join(rooflines)) if rooflines else None)
    for column in ("model", "dtype", "layout", "metric", "ours", "transformers", "ours x"):
        table.add_column(column)
    for r in result["rows"]:
        table.add_row(r["model"], r["dtype"], r["layout"], metrics[r["metric"]][1],
                      number(r["ours"]), number(r["transformers"]), f"{r['ours_speedup']:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
