"""Where an engine step's time goes: torch's profiler per op, and what is left for Python (S1).

For one model (SmolLM2-135M by default), each layout and dtype: a prefill chunk of
`--prompt-len` tokens and decode steps at each `--batches` size, each phase profiled on its
own (`torch.profiler`, CPU). Per phase: the step's wall time, its ops grouped by kind
(projections and MLP GEMMs, attention, KV gathers and appends, RoPE, norms, sampling, the
rest), each op kind's share of the wall, and the time spent outside any op, which is the
Python (and the dispatcher) between them. No assertion: a measurement to decide what to
change, before any speed work. Run: `python benchmarks/profile_engine.py [--dtype bfloat16]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from engine_models import our_engine, write_checkpoint
from result_output import emit
from torch.profiler import ProfilerActivity, profile

from disagg.config import DTYPES, check_dtype
from disagg.engine.llm_engine import LLMEngine
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import LoadedModel, load_model

# Op kinds, by the first pattern found in an op's name (aten's names, lower case). A decode
# step whose layers ran in one C call shows them as one op, the kernels inside it unseen.
KINDS = (("layers_in_c", ("decode_layers",)),  # X8e: a decode step's layers, one call
         ("gemm", ("addmm", "aten::mm", "aten::bmm", "matmul", "linear")),  # small_linear too
         ("attention", ("scaled_dot_product", "attention", "softmax")),
         ("kv_append", ("index_put", "copy_", "scatter")),  # before kv_gather's "index"
         ("kv_gather", ("index_select", "gather", "index", "take")),
         ("rope", ("cat", "neg", "slice")),
         ("norm", ("rsqrt", "pow", "mean", "rms")),
         ("sampling", ("argmax", "topk", "sort", "multinomial", "log_softmax")),
         ("elementwise", ("mul", "add", "silu", "sigmoid", "div", "sub", "to", "empty",
                          "zeros", "arange", "lt", "le", "ge", "where", "masked_fill")))


WARMUP = 3  # steps run before each phase's profile


def kind_of(op: str) -> str:
    name = op.lower()
    for kind, patterns in KINDS:
        if any(p in name for p in patterns):
            return kind
    return "other"


def engine_for(loaded: LoadedModel, layout: str, dtype: torch.dtype, prompt_len: int,
               batch: int, steps: int) -> LLMEngine:
    # No prefix cache: each profiled prefill computes its whole prompt.
    return our_engine(loaded, layout, dtype, prompt_len, batch, steps, prefix_caching=False)


def profiled(step: Any, repeats: int) -> dict[str, Any]:  # noqa: ANN401 - a callable
    """Run `step` `repeats` times under the profiler: wall per step, self CPU time per op kind
    (top-level ops only, so nothing is counted twice) and the time outside ops."""
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            walls.append(time.perf_counter() - start)
    by_kind: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] += event.self_cpu_time_total / 1e3 / repeats
        by_op[event.key] += event.self_cpu_time_total / 1e3 / repeats
    wall_ms = statistics.median(walls) * 1e3
    in_ops = sum(by_kind.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:8]
    return {"wall_ms": wall_ms, "ops_ms": in_ops, "outside_ops_ms": max(0.0, wall_ms - in_ops),
            "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top_ops_ms": dict(top)}


def phases(loaded: LoadedModel, layout: str, dtype: torch.dtype, prompt: list[int],
           batches: list[int], steps: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=10 * steps + WARMUP + 2, ignore_eos=True)
    out: dict[str, Any] = {}
    engine = engine_for(loaded, layout, dtype, len(prompt), 1, steps)

    def prefill() -> None:
        request = engine.add_request(prompt, params)
        engine.step()  # the whole prompt in one chunk
        engine.scheduler.abort_request(request.request_id)

    for _ in range(WARMUP):  # oneDNN primitives, SDPA's choice: made on first use
        prefill()
    out[f"prefill_{len(prompt)}"] = profiled(prefill, 3)
    for batch in batches:
        engine = engine_for(loaded, layout, dtype, len(prompt), batch, 10 * steps)
        for _ in range(batch):
            engine.add_request(prompt, params)
            engine.step()
        for _ in range(WARMUP):
            engine.step()
        out[f"decode_batch{batch}"] = profiled(engine.step, steps)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", default=["NHD", "HND"])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="engine-profile-") as directory:
        write_checkpoint(args.model, Path(directory))
        loaded = load_model(directory)
        prompt = torch.randint(10, loaded.config.vocab_size, (args.prompt_len,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        for dtype in args.dtype:
            for layout in args.layouts:
                for phase, numbers in phases(loaded, layout, check_dtype(dtype), prompt,
                                             args.batches, args.steps).items():
                    rows.append({"dtype": dtype, "layout": layout, "phase": phase, **numbers})
    result = {"model": args.model, "threads": args.threads, "torch": torch.__version__,
              "rows": rows}
    emit(args, result, print_table)
    return result


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    kinds = [kind for kind, _ in KINDS] + ["other"]
    table = Table(title=f"{result['model']}: ms per step by op kind ({result['threads']} "
                        "threads); outside = wall - ops (Python, dispatch)")
    for column in ("dtype", "layout", "phase", "wall", "outside", *kinds):
        table.add_column(column, justify="left" if column in ("dtype", "layout", "phase")
                         else "right")
    for row in result["rows"]:
        table.add_row(row["dtype"], row["layout"], row["phase"], f"{row['wall_ms']:.1f}",
                      f"{row['outside_ops_ms']:.1f}",
                      *(f"{row['by_kind_ms'].get(kind, 0.0):.1f}" for kind in kinds))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
