"""Decode step time, eager path against the static-buffer path, per batch bucket (S3b).

For each batch size, `batch` requests of `--context` prompt tokens are prefilled, then the same
pure-decode batch runs `--steps` times through each path of one engine: the packed eager path
(`ModelRunner` without graphs) and the static path (`DecodeGraphs`). On CUDA the static path
is a graph replay (captured before timing), so the ratio is what graphs save; on CPU it is the
same forward run eagerly over padded static buffers, so the ratio is what padding costs.
The paths alternate step by step; reported: median and best milliseconds per step of each
path, and the largest logit difference between them.
Random-init preset weights. Prints a rich table; `--json` prints one object instead.
Run: `python benchmarks/graph_decode.py [--model small] [--context 256] [--threads 1] [--json]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `benchmarks/disagg.py` shares the package's name: the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from disagg.engine.llm_engine import LLMEngine, build_engine  # noqa: E402
from disagg.engine.request import SamplingParams  # noqa: E402
from disagg.model.loading.registry import init_random_weights  # noqa: E402


def time_ms(run: Callable[[], Any], device: torch.device) -> float:
    """Wall time of one call of `run` in milliseconds, the device drained around it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def decoding_engine(model: ModelConfig, batch: int, context: int, device: str,
                    batch_sizes: tuple[int, ...]) -> LLMEngine:
    """A `cuda_graph` engine whose `batch` requests have all finished prefill."""
    page_size, max_tokens = 16, 4 * batch  # nobody finishes before the last prompt is in
    num_pages = batch * (-(-(context + max_tokens) // page_size)) + 2
    config = EngineConfig(model, CacheConfig(page_size, num_pages),
                          SchedulerConfig(max_num_seqs=max(batch_sizes),
                                          max_num_batched_tokens=max(context, 64) * 2),
                          device=device, cuda_graph=True, graph_batch_sizes=batch_sizes)
    engine = build_engine(config, init_random_weights(model, seed=0))
    generator = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(3, model.vocab_size, (context,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    return engine


def measure(model: ModelConfig, batch: int, context: int, device: str, steps: int,
            batch_sizes: tuple[int, ...]) -> dict[str, Any]:
    """One row: both paths over the same decode batch (it rewrites the same slots each run)."""
    engine = decoding_engine(model, batch, context, device, batch_sizes)
    runner, graphs = engine.runner, engine.runner.graphs
    decode = engine.scheduler.schedule()
    bucket = graphs.bucket(decode)
    assert bucket is not None, f"batch of {batch} does not fit a bucket of {batch_sizes}"
    assert len(decode.chunks) == batch and decode.is_pure_decode
    static_out = runner.execute(decode)  # captures on CUDA
    runner.graphs = None
    eager_out = runner.execute(decode)
    # Alternate the paths so a burst of load from elsewhere hits both alike.
    times: dict[str, list[float]] = {"eager": [], "static": []}
    for _ in range(steps):
        for path, path_graphs in (("eager", None), ("static", graphs)):
            runner.graphs = path_graphs
            times[path].append(time_ms(lambda: runner.execute(decode), engine.kv_cache.device))
    runner.graphs = graphs
    eager_ms, static_ms = (statistics.median(times[path]) for path in ("eager", "static"))
    return {"batch": batch, "batch_bucket": bucket[0], "pages_bucket": bucket[1],
            "eager_ms": eager_ms, "static_ms": static_ms, "speedup": eager_ms / static_ms,
            "eager_min_ms": min(times["eager"]), "static_min_ms": min(times["static"]),
            "max_abs_logit_diff": float((static_out.logits - eager_out.logits).abs().max()),
            "graph_stats": runner.graph_stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="ModelConfig preset")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = tuple(int(size) for size in args.batch_sizes.split(","))
    model = ModelConfig.from_name(args.model)
    rows = [measure(model, size, args.context, args.device, args.steps, sizes)
            for size in sizes]
    result = {"device": args.device, "model": args.model, "context": args.context,
              "steps": args.steps, "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    path = "graph replay" if args.device.startswith("cuda") else "static, eager on CPU"
    table = Table(title=f"decode step, {args.model}, {args.context}-token contexts, "
                        f"{args.device} ({path})")
    # bucket: batch x pages; ratio: eager over static medians (above 1: static is faster).
    for column in ("batch", "bucket", "eager ms", "static ms", "ratio", "eager min", "static min",
                   "max Δlogit"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["batch"]), f"{row['batch_bucket']}x{row['pages_bucket']}",
                      f"{row['eager_ms']:.3f}", f"{row['static_ms']:.3f}",
                      f"{row['speedup']:.2f}", f"{row['eager_min_ms']:.3f}",
                      f"{row['static_min_ms']:.3f}", f"{row['max_abs_logit_diff']:.1e}")
    Console().print(table)


if __name__ == "__main__":
    main()
