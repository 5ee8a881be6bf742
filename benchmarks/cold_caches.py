"""What a decode step's Python costs once the step's weights have gone through the caches (S1,
X8e).

A batch-1 decode step streams every weight once (SmolLM2 bfloat16: 270 MB, Qwen3-MoE small:
42 MB), far more than the last-level cache, so the Python around the one C call (the batch's
tensors, the final norm, the sampling) finds its objects, the interpreter's and torch's
dispatch code and data evicted. This times a few of those small operations hot (back to back)
and right after reading a buffer of each `--sizes-mib` size, the way a step reads its weights
(in huge pages where the kernel gives them, as the weights are, X8f): per size and operation
the median microseconds and the ratio to the hot time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from disagg.model.huge_pages import huge_page_buffer, huge_pages_available
from disagg.model.norms import RMSNorm
from result_output import emit

HIDDEN = 576  # SmolLM2-135M's hidden size: its final norm
PAGES = 64  # a 1,024-token request's page ids at 16 tokens a page


def operations() -> dict[str, Callable[[], object]]:
    """Small operations of a decode step's Python, by name."""
    norm = RMSNorm(HIDDEN, 1e-5).to(torch.bfloat16)
    row = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    page_ids = list(range(PAGES))
    return {
        "final norm (module, C kernel)": lambda: norm(row),
        f"torch.tensor of {PAGES} page ids": lambda: torch.tensor(page_ids, dtype=torch.int64),
        "positions (arange, cat)": lambda: torch.cat([torch.arange(1000, 1001)]),
    }


def time_after(op: Callable[[], object], buffer: torch.Tensor | None, reps: int) -> float:
    """Median microseconds of `op`, each run right after a full read of `buffer` (None: after
    the previous run, hot)."""
    samples = []
    for _ in range(reps):
        if buffer is not None:
            buffer.sum()  # reads every byte, as a step reads its weights
        start = time.perf_counter_ns()
        op()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples)


def _buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of float32 ones, in huge pages where available."""
    if not huge_pages_available():
        return torch.ones(nbytes // 4, dtype=torch.float32)
    return huge_page_buffer(nbytes).view(torch.float32).fill_(1.0)


def measure(sizes_mib: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    ops = operations()
    with torch.inference_mode():
        for op in ops.values():  # imports and first-call setup out of the way
            op()
        hot = {name: time_after(op, None, reps) for name, op in ops.items()}
        for size in sizes_mib:
            buffer = _buffer(size << 20) if size else None
            for name, op in ops.items():
                us = time_after(op, buffer, reps) if buffer is not None else hot[name]
                rows.append({"streamed_mib": size, "operation": name, "us_median": us,
                             "over_hot": us / hot[name]})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[0, 1, 8, 24, 64, 256],
                        help="bytes read before each timed run (0: none, hot)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.reps < 1 or min(args.sizes_mib) < 0:
        parser.error("--reps must be positive and --sizes-mib not negative")
    return args


def print_table(result: dict[str, Any]) -> None:
    table = Table(title=f"a step's Python after its weights' read ({result['cpu']})")
    for heading in ("MiB read before", "operation", "us (median)", "x hot"):
        table.add_column(heading)
    for row in result["rows"]:
        table.add_row(str(row["streamed_mib"]), row["operation"], f"{row['us_median']:.1f}",
                      f"{row['over_hot']:.1f}")
    Console().print(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
              "huge_pages": huge_pages_available(),
              "reps": args.reps, "rows": measure(args.sizes_mib, args.reps)}
    emit(args, result, print_table)
    return result


if __name__ == "__main__":
    main()
