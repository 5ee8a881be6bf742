"""The messengers' KV path against prepared writes, per write, between two processes (S5, S4c, S3b).

    python benchmarks/messenger_path.py [--provider tcp|shm|all] [--requests R] [--pages P]
        [--layers L] [--page-writes W] [--write-bytes B] [--reps N] [--json]

The measurement is `disagg.kv_transfer.messenger_bench` (its docstring says what each path
posts and what is timed; `disagg bench transfer` runs it too). This prints its table, or with
`--json` one object; with one provider the flat object `transfer_compare.py` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg.kv_transfer.messenger_bench import Shape, measure  # noqa: E402


def flat(result: dict[str, Any], transport: str) -> dict[str, Any]:
    """The one-provider object `transfer_compare.py` reads (the messenger path's numbers)."""
    m, p = result["paths"]["messenger"], result["paths"]["prepared"]
    return {"engine": "ours-messenger", "transport": transport, "gbps": m["gbps"],
            "us_per_page": m["us_per_write"], "latency_us_p50": None, "latency_us_p99": None,
            "us_per_write_messenger": m["us_per_write"], "us_per_write_prepared":
            p["us_per_write"], "pages": result["writes"], "page_bytes": result["write_bytes"],
            **{k: result[k] for k in ("messenger_over_prepared", "verified")}}


def _table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="A forward's KV writes: messenger path against prepared writes")
    for col in ("provider", "path", "writes", "µs/write (min-max)", "GB/s", "time ratio",
                "verified"):
        table.add_column(col, justify="right")
    for r in results:
        for path, m in r["paths"].items():
            ratio = {"messenger": f"{r['messenger_over_prepared']:.2f} ({r['ratio_min']:.2f}-"
                                  f"{r['ratio_max']:.2f}) of prepared",
                     "ungrouped": f"{r['ungrouped_over_messenger']:.2f} of messenger"}.get(path, "")
            table.add_row(r["provider"], path, str(r["writes"]),
                          f"{m['us_per_write']:.2f} ({m['us_min']:.2f}-{m['us_max']:.2f})",
                          f"{m['gbps']:.2f}", ratio, str(r["verified"]))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="all", help="tcp, shm or all")
    shape = Shape()
    for flag, default in (("layers", shape.num_layers), ("requests", shape.num_requests),
                          ("pages", shape.num_pages), ("page-writes", shape.page_writes),
                          ("write-bytes", shape.write_bytes), ("reps", 5)):  # pages: per request
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    shape = Shape(args.layers, args.requests, args.pages, args.page_writes, args.write_bytes)
    providers = ["tcp", "shm"] if args.provider == "all" else [args.provider]
    results = [measure(p, shape, args.reps) for p in providers]
    if args.json and len(results) == 1:
        print(json.dumps(flat(results[0], args.provider)))
    elif args.json:
        print(json.dumps(dict(zip(providers, results, strict=True))))
    else:
        Console(width=max(Console().width, 110)).print(_table(results))
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
