"""Transfer benchmark CLI: two peer processes writing scattered pages, checksummed, over tcp
and/or shm (S5).

    python benchmarks/transfer.py [--provider tcp|shm|all|NAME] [--pages N] [--page-size B]
                                  [--reps R] [--warmup W] [--json] [--no-wait-idle]
                                  [--verify-each-rep]
                                  [--one-buffer]

Prints a rich table, or with --json one JSON object on one line (for `--provider all`, an
object keyed by provider). Exits 1 if a run failed checksum verification. The logic lives in
`transfer_core.bench.run_transfer_benchmark`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transfer_core.bench import run_transfer_benchmark  # noqa: E402


def _table(results: list[dict]) -> Table:
    table = Table(title="transfer_core: paged writes to shuffled slots + 4 KiB write latency")
    for column in (
        "provider",
        "pages x bytes",
        "GB/s (min-max)",
        "µs/page",
        "lat p50 µs",
        "lat p99 µs",
        "verified",
        "busy before",
        "memcpy GB/s",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["provider"],
            f"{r['num_pages']} x {r['page_bytes']}",
            f"{r['gbps']:.2f} ({r['gbps_min']:.2f}-{r['gbps_max']:.2f})",
            f"{r['us_per_page']:.2f}",
            f"{r['latency_us_p50']:.1f}",
            f"{r['latency_us_p99']:.1f}",
            str(r["verified"]),
            f"{r['cpu_busy_before']:.0%}",
            f"{r['memcpy_gbps']:.1f}",
        )
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="tcp", help="tcp, shm, all, or a libfabric name")
    parser.add_argument("--pages", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=65536, help="bytes per page")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed batches before the reps")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-wait-idle", action="store_true", help="skip waiting for idle CPUs")
    parser.add_argument(
        "--verify-each-rep",
        action="store_true",
        help="zero and verify the receiver's region around every rep (cold batches), not once",
    )
    parser.add_argument(
        "--one-buffer",
        action="store_true",
        help="every write from one page to one page, as fi_rma_bw writes (stays in cache)",
    )
    args = parser.parse_args()
    providers = ["tcp", "shm"] if args.provider == "all" else [args.provider]
    results = [
        run_transfer_benchmark(
            p,
            num_pages=args.pages,
            page_bytes=args.page_size,
            reps=args.reps,
            warmup=args.warmup,
            wait_idle=not args.no_wait_idle,
            verify_each_rep=args.verify_each_rep,
            one_buffer=args.one_buffer,
        )
        for p in providers
    ]
    if args.json:
        payload = results[0] if len(results) == 1 else dict(zip(providers, results, strict=True))
        print(json.dumps(payload))
    else:
        Console(width=max(Console().width, 120)).print(_table(results))
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
