"""`disagg bench`: the benchmarks a user runs from the command line (S5).

`bench transfer` is the transfer core's peer workload (`transfer_core.bench`): pages written to
shuffled slots of another process, then the latency of a 4 KiB write, per provider; the
provider is checked before two processes start. `disagg.apps.cli` adds it with
`register(app)`.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def register(app: typer.Typer) -> None:
    """Add `disagg bench ...` to `app`."""
    bench_app = typer.Typer(help="Benchmarks (JSON with --json, else a table).",
                            no_args_is_help=True)
    app.add_typer(bench_app, name="bench")

    @bench_app.command("transfer")
    def bench_transfer(
        provider: Annotated[str, typer.Option(help="libfabric provider: tcp, shm, or all")] = "tcp",
        pages: Annotated[int, typer.Option(help="Pages in the batch")] = 2048,
        page_size: Annotated[int, typer.Option(help="Bytes per page")] = 65536,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    ) -> None:
        """Peer workload: N pages to shuffled slots of another process, and 4 KiB latency."""
        results = measure_transfer(["tcp", "shm"] if provider == "all" else [provider], pages,
                                   page_size)
        if as_json:
            sys.stdout.write(json.dumps(results[0] if len(results) == 1 else results) + "\n")
            return
        Console().print(transfer_table(results, pages, page_size))


def measure_transfer(providers: list[str], pages: int, page_size: int) -> list[dict]:
    """One run of the peer workload per provider, with progress on stderr."""
    from disagg.apps.progress import StartupProgress
    from disagg.node.preflight import check_provider
    from transfer_core.bench import run_transfer_benchmark

    for name in providers:
        check_provider(name)  # before two processes start and register their pages
    results = []
    with StartupProgress() as progress:
        for name in providers:
            with progress.phase(f"{name}: {pages} pages of {page_size} B, then 4 KiB latency",
                                done=f"[green]✓[/green] {name} measured"):
                results.append(run_transfer_benchmark(provider=name, num_pages=pages,
                                                      page_bytes=page_size))
    return results


def transfer_table(results: list[dict], pages: int, page_size: int) -> Table:
    table = Table(title=f"transfer: {pages} pages x {page_size} B")
    for column in ("provider", "GB/s", "µs/page", "4 KiB p50 µs", "4 KiB p99 µs", "verified"):
        table.add_column(column)
    for r in results:
        table.add_row(r["provider"], f"{r['gbps']:.2f}", f"{r['us_per_page']:.2f}",
                      f"{r['latency_us_p50']:.1f}", f"{r['latency_us_p99']:.1f}",
                      str(r["verified"]))
    return table
