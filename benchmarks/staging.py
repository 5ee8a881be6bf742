"""KV pages through the fabric: registered directly against staged through a host shadow (S5).

Two transfer engines in one process (loopback) move every layer of half a KV cache's pages,
scattered, from one cache to another, the way the prefill messenger does: per layer,
`stage_out` then one paged-write call; the receiver's `stage_in` once the counter fired.
Paths alternate run by run so both see the same machine: on CPU "host" (the NIC reads the
cache) against "staged" (forced); on CUDA "auto" (FI_HMEM if the provider has it, else
staged) against "staged". Reported: median GB/s of each, the ratio, the share of the staged
run spent copying, and every run verified byte-exact.
Run: `python benchmarks/staging.py [--provider tcp|shm] [--device cpu|cuda] [--json]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `benchmarks/disagg.py` shares the package's name: the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from transfer_core.engine import TransferEngine  # noqa: E402
from transfer_core.staging import open_engine, register_kv  # noqa: E402
from transfer_core.transport import PagedWrite  # noqa: E402

PAGE_SHAPE = (2, 16, 8, 128)  # K/V x tokens x heads x dim, bf16: 64 KiB pages
IMM = 5


def one_run(provider: str, device: str, path: str, layers: int, pages: int,
            seed: int) -> dict[str, float | bool | str | int]:
    """Move half the pages of every layer once: GB/s, the share spent copying, whether the
    pages arrived exactly and nothing else changed, the path taken and why."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn((layers, pages, *PAGE_SHAPE), generator=generator).to(torch.bfloat16)
    src_pages = torch.randperm(pages, generator=generator)[:pages // 2].tolist()
    dst_pages = torch.randperm(pages, generator=generator)[:pages // 2].tolist()
    want_hmem = device == "cuda" and path == "auto"

    def make(hmem: bool) -> TransferEngine:
        return TransferEngine(provider, hmem=hmem)

    with open_engine(make, want_hmem) as sender, open_engine(make, want_hmem) as receiver:
        src = register_kv(sender, kv.to(device), "bench-src", path)
        dst = register_kv(receiver, torch.zeros_like(src.tensor), "bench-dst", path)
        page_nbytes = kv[0, 0].numel() * kv.element_size()
        layer_nbytes = pages * page_nbytes
        landed = threading.Event()
        receiver.expect_imm_count(IMM, layers * len(src_pages), landed.set)
        copying = 0.0
        started = time.perf_counter()
        for layer in range(layers):
            copy_started = time.perf_counter()
            src.stage_out(layer, src_pages)
            copying += time.perf_counter() - copy_started
            sender.post_paged_writes(PagedWrite(src.region, src_pages, page_nbytes,
                                                  layer * layer_nbytes, dst.descriptor, dst_pages,
                                                  page_nbytes, layer * layer_nbytes, page_nbytes,
                                                  IMM))
        if not landed.wait(300):
            raise TimeoutError(f"{receiver.imm_counted(IMM)} writes landed")
        copy_started = time.perf_counter()
        dst.stage_in(dst_pages)
        copying += time.perf_counter() - copy_started
        seconds = time.perf_counter() - started
        untouched = sorted(set(range(pages)) - set(dst_pages))
        exact = (torch.equal(dst.tensor[:, dst_pages].cpu(), kv[:, src_pages])
                 and not dst.tensor[:, untouched].any().item())
        chosen = src.path
        src.close(sender)
        dst.close(receiver)
    nbytes = layers * len(src_pages) * page_nbytes
    return {"gbps": nbytes / seconds / 1e9, "copy_share": copying / seconds, "exact": exact,
            "path": chosen.kind, "reason": chosen.reason, "nbytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="tcp")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    direct = "auto" if args.device == "cuda" else "host"
    runs: dict[str, list[dict]] = {direct: [], "staged": []}
    for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
        for path in runs:
            run = one_run(args.provider, args.device, path, args.layers, args.pages, repeat)
            if repeat:
                runs[path].append(run)
    summary = {path: {"path": found[0]["path"],
                      "gbps_median": statistics.median(r["gbps"] for r in found),
                      "gbps_runs": [round(r["gbps"], 3) for r in found],
                      "copy_share_median": statistics.median(r["copy_share"] for r in found),
                      "all_exact": all(r["exact"] for r in found)}
               for path, found in runs.items()}
    result = {"provider": args.provider, "device": args.device, "layers": args.layers,
              "pages": args.pages, "page_bytes": 2 * 16 * 8 * 128 * 2, "paths": summary,
              "staged_over_direct": summary["staged"]["gbps_median"]
              / summary[direct]["gbps_median"]}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    table = Table(title=f"KV pages over {args.provider} from {args.device} memory, "
                        f"{args.layers} layers x {args.pages // 2} pages x 64 KiB")
    for column in ("asked", "path", "GB/s (median)", "runs", "copying", "byte-exact"):
        table.add_column(column)
    for asked, row in summary.items():
        table.add_row(asked, row["path"], f"{row['gbps_median']:.2f}",
                      " ".join(f"{g:.2f}" for g in row["gbps_runs"]),
                      f"{row['copy_share_median']:.0%}", str(row["all_exact"]))
    Console().print(table)
    Console().print(f"staged / {direct}: {result['staged_over_direct']:.2f}x")


if __name__ == "__main__":
    main()
