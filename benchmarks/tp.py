"""Tensor parallelism on this machine: step time at TP 1/2/4, and matched TP 2's page transfer
through one domain versus two (S3c, S6a). JSON plus a table.

    python benchmarks/tp.py [--model small] [--tps 1,2,4] [--pages 512] [--reps 5] [--json]

Part 1 times an engine's steps with its ranks as real processes (gloo on loopback): one
256-token prefill chunk and a decode step of 8 requests, median of `--reps`; each of the TP
processes gets its share of the cores' torch threads. Part 2 is the S6a
claim, "more NICs, more bandwidth": two ranks' KV regions sent rank i -> rank i, every write
through one domain, or rank i's through domain i, tcp on loopback, measured until the
receiver counted every immediate. Honest limits: two CPU cores share every rank and every
progress thread, and loopback tcp is one kernel, not two NICs; a GPU node with a NIC per GPU
is where the second domain pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from disagg.engine.llm_engine import build_engine  # noqa: E402
from disagg.engine.request import SamplingParams  # noqa: E402
from disagg.model.loading.registry import load_model  # noqa: E402
from transfer_core.engine import TransferEngine  # noqa: E402
from transfer_core.transport import PagedWrite  # noqa: E402


def step_times(model: str, tp: int, reps: int) -> dict[str, Any]:
    """Median ms of a 256-token prefill step and of an 8-request decode step at TP `tp`."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))  # as each rank does
    loaded = load_model(model)
    config = EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=256,
                                                     prefix_caching=False),
                          SchedulerConfig(chunk_size=256, max_num_batched_tokens=256),
                          ParallelConfig(tp))
    engine = build_engine(config, loaded.state_dict, model_spec=model)
    params = SamplingParams(max_tokens=reps + 2, ignore_eos=True)
    try:
        prefill, decode = [], []
        for rep in range(reps + 1):  # the first of each is a warm-up
            engine.add_request(list(range(3 + rep, 259 + rep)), SamplingParams(max_tokens=1))
            start = time.perf_counter()
            engine.step()
            if rep:
                prefill.append(time.perf_counter() - start)
            while engine.has_unfinished():
                engine.step()
        for n in range(8):
            engine.add_request(list(range(5, 13 + n)), params)
        while any(r.num_computed_tokens == 0 for r in engine.scheduler.waiting):
            engine.step()
        engine.step()  # every request decoding from here on
        for rep in range(reps):
            start = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - start)
    finally:
        engine.close()
    return {"tp": tp, "prefill_ms": 1e3 * statistics.median(prefill),
            "decode_ms": 1e3 * statistics.median(decode)}


def transfer_gbps(num_domains: int, pages: int, page_bytes: int, reps: int) -> dict[str, Any]:
    """Matched TP 2: rank r's `pages` pages to the peer's rank r, through domain r (2 domains)
    or all through domain 0 (1 domain); GB/s of both ranks' bytes, median of `reps`."""
    sender = TransferEngine("tcp", num_domains=num_domains)
    receiver = TransferEngine("tcp", num_domains=num_domains)
    try:
        src = [np.random.default_rng(r).integers(0, 255, (pages, page_bytes), dtype=np.uint8)
               for r in range(2)]
        dst = [np.zeros((pages, page_bytes), dtype=np.uint8) for _ in range(2)]
        src_mr = [sender.register_memory(s, name=f"src{r}", remote_write=False)[0]
                  for r, s in enumerate(src)]
        dst_desc = [receiver.register_memory(d, name=f"dst{r}")[1] for r, d in enumerate(dst)]
        sender.connect(receiver.address)
        ids = np.arange(pages)
        rates = []
        for rep in range(reps + 1):
            imm, counted = 1000 + rep, threading.Event()
            receiver.expect_imm_count(imm, 2 * pages, counted.set)
            start = time.perf_counter()
            for rank in range(2):
                sender.post_paged_writes(PagedWrite(src_mr[rank], ids, page_bytes, 0,
                                                      dst_desc[rank], ids, page_bytes, 0,
                                                      page_bytes, imm, [rank % num_domains]))
            if not counted.wait(60):
                raise TimeoutError(f"{num_domains} domain(s): the receiver counted too few")
            if rep:  # the first is a warm-up
                rates.append(2 * pages * page_bytes / (time.perf_counter() - start) / 1e9)
        assert all(np.array_equal(s, d) for s, d in zip(src, dst, strict=True))
        per_domain = [s.bytes_written for s in sender.stats()]
    finally:
        sender.close()
        receiver.close()
    return {"domains": num_domains, "gbps": statistics.median(rates),
            "gbps_min": min(rates), "gbps_max": max(rates), "bytes_per_domain": per_domain}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--tps", default="1,2,4")
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--page-bytes", type=int, default=64 * 1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    steps = [step_times(args.model, int(tp), args.reps) for tp in args.tps.split(",")]
    transfers = [transfer_gbps(d, args.pages, args.page_bytes, args.reps) for d in (1, 2)]
    result = {"model": args.model, "steps": steps, "transfer": transfers,
              "two_domains_over_one": transfers[1]["gbps"] / transfers[0]["gbps"]}
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    table = Table(title=f"step time with TP rank processes ({args.model}, gloo on loopback)")
    for column in ("TP", "prefill 256 tokens, ms", "decode 8 requests, ms"):
        table.add_column(column, justify="right")
    for s in steps:
        table.add_row(str(s["tp"]), f"{s['prefill_ms']:.1f}", f"{s['decode_ms']:.1f}")
    console.print(table)
    table = Table(title=f"matched TP 2, {args.pages} x {args.page_bytes} B per rank, tcp")
    for column in ("domains", "GB/s (min-max)", "bytes per domain"):
        table.add_column(column, justify="right")
    for t in transfers:
        table.add_row(str(t["domains"]), f"{t['gbps']:.2f} ({t['gbps_min']:.2f}-"
                      f"{t['gbps_max']:.2f})", ", ".join(str(b) for b in t["bytes_per_domain"]))
    console.print(table)
    console.print(f"two domains / one: {result['two_domains_over_one']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
