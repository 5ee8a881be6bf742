"""Single-node engine speed against Hugging Face transformers, side by side in one run (S1, S9b).

For each model (SmolLM2-135M and a random Qwen3-MoE by default) and each dtype (float32 and
bfloat16), both sides load the same Hugging Face checkpoint (`engine_models.py`) and run in that
dtype on the same threads: prefill tokens/s of one prompt, and the time of one decode step at
batch 1 and 8, for our paged engine in both KV layouts and for transformers' own KV-cached
forward. The three engines take turns within every rep (median of `--reps`), so a busy spell on
the machine hits all of them. Every row pairs ours with transformers: `ratio` is
transformers / ours, `ours_speedup` says how many times faster ours is whatever the unit.
Run: `python benchmarks/engine.py [--models smollm2-135m qwen3-moe-small] [--dtype bfloat16]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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

from disagg.config import DTYPES, check_dtype
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import LoadedModel, load_model

BATCHES = (1, 8)
LAYOUTS = ("NHD", "HND")
# Each metric, whether a higher value is the faster engine, and its table heading.
METRICS = {"prefill_tokens_per_s": (True, "prefill tok/s"),
           "decode_step_ms_batch1": (False, "decode ms, batch 1"),
           "decode_step_ms_batch8": (False, "decode ms, batch 8")}
Sample = tuple[float, float]  # (prefill seconds of one prompt, seconds per decode step)


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


def ours(loaded: LoadedModel, kv_layout: str, dtype: torch.dtype, prompt: list[int],
         batch: int, steps: int) -> Sample:
    """Our paged engine in `dtype` (weights, activations and KV): one prompt's prefill, then
    the median decode step with `batch` requests running."""
    engine = our_engine(loaded, kv_layout, dtype, len(prompt), batch, steps)
    assert engine.model.embed_tokens.weight.dtype == dtype, "our engine runs in another dtype"
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    engine.step()  # the whole prompt in one chunk, first token sampled
    prefill = time.perf_counter() - start
    for _ in range(batch - 1):
        engine.add_request(prompt, params)
        engine.step()
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    return prefill, statistics.median(step_times)


def reference(hf_model: torch.nn.Module, prompt: list[int], batch: int, steps: int) -> Sample:
    """The same measurement with transformers' forward and DynamicCache. The prefill computes
    the last position's logits only (`logits_to_keep=1`, as its `generate` does, and ours)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_model(ids, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1)
        prefill = time.perf_counter() - start
        out = hf_model(ids.repeat(batch, 1), use_cache=True, logits_to_keep=1)
        cache, next_ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
        step_times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = hf_model(next_ids, past_key_values=cache, use_cache=True)
            next_ids = out.logits[:, -1:].argmax(-1)
            step_times.append(time.perf_counter() - start)
            cache = out.past_key_values
    return prefill, statistics.median(step_times)


def measure(directory: Path, loaded: LoadedModel, dtype: torch.dtype, prompt: list[int],
            steps: int, reps: int) -> dict[str, dict[int, list[Sample]]]:
    """Samples by engine ("ours-NHD", "ours-HND", "transformers") and batch size, the engines
    taking turns in every rep (in a rotated order, so that none always runs first). `loaded`
    is our float32 load of `directory`; each engine casts its own copy to `dtype`."""
    hf_model = load_reference(directory, dtype)
    assert hf_model.dtype == dtype, f"transformers loaded {hf_model.dtype}, not {dtype}"
    runs: dict[str, Callable[[int], Sample]] = {
        **{f"ours-{layout}": (lambda b, layout=layout: ours(loaded, layout, dtype, prompt, b,
                                                            steps)) for layout in LAYOUTS},
        "transformers": lambda b: reference(hf_model, prompt, b, steps)}
    samples: dict[str, dict[int, list[Sample]]] = {name: {b: [] for b in BATCHES} for name in runs}
    names = list(runs)
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for batch in BATCHES:
            for name in order:
                samples[name][batch].append(runs[name](batch))
    return samples


def summarize(samples: dict[int, list[Sample]], prompt_len: int) -> dict[str, float]:
    """One engine's metrics: medians over reps (the prefill over both batch sizes' runs)."""
    prefill = statistics.median(s[0] for b in BATCHES for s in samples[b])
    return {"prefill_tokens_per_s": prompt_len / prefill,
            **{f"decode_step_ms_batch{b}": statistics.median(s[1] for s in samples[b]) * 1e3
               for b in BATCHES}}


def rows_of(model: str, dtype: str, samples: dict[str, dict[int, list[Sample]]],
            prompt_len: int) -> list[dict[str, Any]]:
    """One row per (layout, metric): ours beside transformers, measured in the same reps."""
    theirs = summarize(samples["transformers"], prompt_len)
    rows = []
    for layout in LAYOUTS:
        mine = summarize(samples[f"ours-{layout}"], prompt_len)
        for metric, (higher_is_faster, _) in METRICS.items():
            ratio = theirs[metric] / mine[metric]
            rows.append({"model": model, "dtype": dtype, "layout": layout, "metric": metric,
                         "ours": mine[metric], "transformers": theirs[metric], "ratio": ratio,
                         "ours_speedup": 1 / ratio if higher_is_faster else ratio})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-moe-small"],
                        help="smollm2-135m, a Llama preset, qwen3-moe-small or qwen3-moe-tiny")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=list(DTYPES))
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quiet-wait-s", type=float, default=30.0)
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, rows = time.monotonic(), []
    quiet, busy_before = wait_for_quiet(args.quiet_wait_s)
    meter = CpuMeter()
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="engine-bench-") as directory:
            write_checkpoint(model, Path(directory))
            loaded = load_model(directory)  # once per model, float32
            prompt = torch.randint(10, loaded.config.vocab_size, (args.prompt_len,),
                                   generator=torch.Generator().manual_seed(0)).tolist()
            for dtype in args.dtype:
                samples = measure(Path(directory), loaded, check_dtype(dtype), prompt,
                                  args.steps, args.reps)
                rows += rows_of(model, dtype, samples, args.prompt_len)
    import transformers

    result = {"prompt_len": args.prompt_len, "steps": args.steps, "reps": args.reps,
              "threads": args.threads, "torch": torch.__version__,
              "transformers": transformers.__version__,
              "transformers_kernels": {"attention": ATTENTION_IMPLEMENTATION,
                                       "experts": EXPERTS_IMPLEMENTATION},
              "quiet_machine": quiet, "others_cpu_share_before": busy_before,
              "others_cpu_share_during": meter.others_share(),
              "wall_s": time.monotonic() - started, "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    busy = result["others_cpu_share_during"]
    table = Table(title=f"ours vs transformers {result['transformers']}, prompt "
                        f"{result['prompt_len']}, {result['threads']} threads, median of "
                        f"{result['reps']}; other processes took {busy:.0%} of the CPU")
    for column in ("model", "dtype", "layout", "metric", "ours", "transformers",
                   "transformers/ours", "ours faster x"):
        table.add_column(column)
    for r in result["rows"]:
        table.add_row(r["model"], r["dtype"], r["layout"], METRICS[r["metric"]][1],
                      f"{r['ours']:.2f}", f"{r['transformers']:.2f}", f"{r['ratio']:.2f}",
                      f"{r['ours_speedup']:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
