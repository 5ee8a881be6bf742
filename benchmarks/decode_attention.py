"""A decode's attention in C against PyTorch's gather and SDPA, on real models' shapes (X8b).

For each model shape (query heads over KV heads, head_dim), KV length, batch, dtype and layout:
one layer's decode attention over a paged cache (page size 16, every sequence `kv_len` tokens,
its pages scattered through the cache), timed two ways in one process, taking turns:

- `kernel`: `decode_attention` (`decode_attention.c`, read in place), as `attention.py` calls it;
- `pytorch`: what runs without the kernel (`attention.py`'s batched decode): every page of the
  batch gathered into one padded K and V, then SDPA with the query heads as rows of their KV
  head and a mask of the lengths.

Each is timed hot (the same layer again and again: its KV in the caches) and cold (after reading
`--evict-mib` of other memory, as a decode step's weights evict the KV between two layers).
Per path, the median of four turns' medians of `--reps` calls, microseconds (the paths alternate
turn by turn); `speedup` is pytorch / kernel. The two outputs are
checked against each other first. No assertion on speed: run it to compare builds side by side.
`python benchmarks/decode_attention.py [--shapes ...] [--kv-lens 512 2048] [--batches 1 8]
[--json] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from result_output import emit

from disagg.config import DTYPES, CacheConfig, ModelConfig, check_dtype
from disagg.model.attention import grouped_queries
from disagg.model.cpu_kernels import AVX512
from disagg.model.decode_attention import decode_attention
from disagg.model.kv_cache import PagedKVCache

# (query heads, KV heads, head_dim) of the models whose decode this engine runs or reproduces.
SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-moe-small": (8, 4, 64),
          "llama-3-8b": (32, 8, 128), "tiny": (4, 2, 8)}
PAGE_SIZE = 16


def cache_for(shape: tuple[int, int, int], layout: str, dtype: torch.dtype, pages: int
              ) -> PagedKVCache:
    heads, kv_heads, dim = shape
    config = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=1, num_heads=heads,
                                 num_kv_heads=kv_heads, head_dim=dim, hidden_size=heads * dim)
    cache = PagedKVCache(config, CacheConfig(page_size=PAGE_SIZE, num_pages=pages,
                                             kv_layout=layout, dtype=dtype))
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def pytorch_decode(q: torch.Tensor, cache: PagedKVCache, table: torch.Tensor,
                   lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention.py`'s decode without the kernel: gather, mask, SDPA."""
    k, v = cache.gather_batch(0, table)
    mask = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(grouped_queries(q, k.shape[1]), k, v, attn_mask=mask,
                                         scale=scale)
    return out.reshape(q.shape)


def timed(call: Any, reps: int, evict: torch.Tensor | None) -> float:  # noqa: ANN401
    """Median microseconds of `call()`; before each, `evict` is read when given."""
    samples = []
    for _ in range(reps):
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def measure(name: str, kv_len: int, batch: int, dtype: torch.dtype, layout: str, reps: int,
            evict: torch.Tensor) -> dict[str, Any]:
    shape = SHAPES[name]
    per_seq = -(-kv_len // PAGE_SIZE)
    cache = cache_for(shape, layout, dtype, 2 * per_seq * batch)
    # Half the cache's pages, drawn at random and in a shuffled order: a request's pages are
    # not contiguous in a cache that has served other requests.
    order = torch.randperm(2 * per_seq * batch, generator=torch.Generator().manual_seed(1))
    table = order[:per_seq * batch].reshape(batch, per_seq).contiguous()
    lens = torch.full((batch,), kv_len, dtype=torch.int64)
    q = torch.randn(batch, shape[0], shape[2], generator=torch.Generator().manual_seed(2)
                    ).to(dtype)
    scale = shape[2] ** -0.5
    kernel = lambda: decode_attention(q, cache, 0, table, lens, scale)  # noqa: E731
    pytorch = lambda: pytorch_decode(q, cache, table, lens, scale)  # noqa: E731
    torch.testing.assert_close(kernel().float(), pytorch().float(), rtol=2e-2, atol=2e-2)
    row: dict[str, Any] = {"shape": name, "heads": shape[0], "kv_heads": shape[1],
                           "head_dim": shape[2], "kv_len": kv_len, "batch": batch,
                           "dtype": str(dtype).removeprefix("torch."), "layout": layout}
    for state, memory in (("hot", None), ("cold", evict)):
        us: dict[str, list[float]] = {"kernel": [], "pytorch": []}
        for turn in range(4):  # alternated, so both meet the same minutes of the host
            for path, call in (("kernel", kernel), ("pytorch", pytorch))[::1 - 2 * (turn % 2)]:
                us[path].append(timed(call, reps, memory))
        row[f"{state}_kernel_us"] = statistics.median(us["kernel"])
        row[f"{state}_pytorch_us"] = statistics.median(us["pytorch"])
        row[f"{state}_speedup"] = row[f"{state}_pytorch_us"] / row[f"{state}_kernel_us"]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen3-moe-small",
                                                        "llama-3-8b"], choices=list(SHAPES))
    parser.add_argument("--kv-lens", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", default=["NHD", "HND"])
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--evict-mib", type=int, default=64,
                        help="memory read before each cold call (above the last cache level)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not AVX512:
        parser.error("the kernel needs AVX-512 and the built kernels (DISAGG_CPU_KERNELS=1)")
    torch.set_num_threads(args.threads)
    evict = torch.ones(args.evict_mib << 18)  # float32: MiB * 2**20 / 4
    rows = [measure(name, kv_len, batch, check_dtype(dtype), layout, args.reps, evict)
            for name in args.shapes for kv_len in args.kv_lens for batch in args.batches
            for dtype in args.dtype for layout in args.layouts]
    result = {"threads": args.threads, "torch": torch.__version__, "reps": args.reps,
              "evict_mib": args.evict_mib, "rows": rows}
    emit(args, result, print_table)
    return result


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one layer's decode attention, us (median of {result['reps']}, "
                        f"{result['threads']} threads); speedup = pytorch / kernel")
    for column in ("shape", "kv_len", "batch", "dtype", "layout", "hot kernel", "hot pytorch",
                   "hot x", "cold kernel", "cold pytorch", "cold x"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(row["shape"], str(row["kv_len"]), str(row["batch"]), row["dtype"],
                      row["layout"], *(f"{row[f'{state}_{path}']:.1f}" if path != "speedup"
                                       else f"{row[f'{state}_speedup']:.2f}"
                                       for state in ("hot", "cold")
                                       for path in ("kernel_us", "pytorch_us", "speedup")))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
