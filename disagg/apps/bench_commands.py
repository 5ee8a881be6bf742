"""`disagg bench ...`: benchmarks from the command line (S5).

`bench transfer` is the transfer core's peer workload (`transfer_core.bench`): pages written to
shuffled slots of another process, then the latency of a 4 KiB write, per provider, at two
batch sizes: the full workload and a small batch the size of one layer's writes. Beside it,
when it is found, libfabric's own `fi_rma_bw` at the same sizes, with our ratio to it; and
the messengers' KV path per write against prepared writes (`kv_transfer.messenger_bench`). The
provider is checked before two processes start. `disagg.apps.cli` adds it with
`register(app)`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

SMALL_PAGES = 64  # a SmolLM2 layer of 512 tokens at page size 16 is 32 pages of K and V


def register(app: typer.Typer) -> None:
    """Add `disagg bench ...` to `app`."""
    bench_app = typer.Typer(help="Benchmarks (JSON with --json, else a table).",
                            no_args_is_help=True)
    app.add_typer(bench_app, name="bench")

    @bench_app.command("transfer")
    def bench_transfer(
        provider: Annotated[str, typer.Option(help="libfabric provider: tcp, shm, or all")] = "tcp",
        pages: Annotated[int, typer.Option(help="Pages in the batch")] = 2048,
        small_pages: Annotated[int, typer.Option(
            help="Pages in the small batch (0: skip it)")] = SMALL_PAGES,
        page_size: Annotated[int, typer.Option(help="Bytes per page")] = 65536,
        fi_rma_bw: Annotated[str | None, typer.Option(
            help="libfabric's fi_rma_bw to run beside ours (default: $FI_RMA_BW, PATH, "
                 "./.venv-peers/bin; built by benchmarks/peers/build_fi_rma_bw.sh)")] = None,
        messenger: Annotated[bool, typer.Option(
            help="Also the messengers' KV path per write against prepared writes")] = True,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    ) -> None:
        """Peer workload: N pages to shuffled slots of another process, and 4 KiB latency."""
        sizes = [pages, *([small_pages] if 0 < small_pages != pages else [])]
        names = ["tcp", "shm"] if provider == "all" else [provider]
        results = measure_transfer(names, sizes, page_size, _fi_rma_bw(fi_rma_bw), messenger)
        if as_json:
            sys.stdout.write(json.dumps(results[0] if len(results) == 1 else results) + "\n")
            return
        # Piped, the default 80 columns would cut every header; keep the rows whole.
        console = Console(width=None if sys.stdout.isatty() else 120)
        console.print(transfer_table(results, page_size))
        if messenger:
            console.print(messenger_table(results))


def _fi_rma_bw(explicit: str | None) -> Path | None:
    from transfer_core.errors import ReferenceToolError
    from transfer_core.fi_rma_bw import find_fi_rma_bw

    try:
        return find_fi_rma_bw(explicit, also=[Path.cwd() / ".venv-peers" / "bin"])
    except ReferenceToolError as error:
        raise typer.BadParameter(str(error), param_hint="--fi-rma-bw") from error


def measure_transfer(providers: list[str], sizes: list[int], page_size: int,
                     fi_rma_bw: Path | None = None, messenger: bool = False) -> list[dict]:
    """One run of the peer workload per provider and batch size, each with `fi_rma_bw`'s GB/s
    at the same size when a binary is given (and ours on its pattern, one page written again
    and again: `one_buffer_gbps`), and with `messenger` the messengers' path on
    each provider's first row (`messenger`: per write against prepared writes); progress on
    stderr."""
    from disagg.apps.progress import StartupProgress
    from disagg.kv_transfer.messenger_bench import Shape, measure
    from disagg.node.preflight import check_provider
    from transfer_core.bench import run_transfer_benchmark
    from transfer_core.errors import ReferenceToolError
    from transfer_core.fi_rma_bw import run_fi_rma_bw

    for name in providers:
        check_provider(name)  # before two processes start and register their pages
    results = []
    with StartupProgress() as progress:
        for name in providers:
            for pages in sizes:
                with progress.phase(f"{name}: {pages} pages of {page_size} B, then 4 KiB latency",
                                    done=f"[green]✓[/green] {name}, {pages} pages measured"):
                    result = run_transfer_benchmark(provider=name, num_pages=pages,
                                                    page_bytes=page_size)
                if fi_rma_bw is not None:
                    with progress.phase(f"{name}: ours on fi_rma_bw's pattern (one page)",
                                        done=f"[green]✓[/green] {name}, one page measured"):
                        result["one_buffer_gbps"] = run_transfer_benchmark(
                            provider=name, num_pages=pages, page_bytes=page_size,
                            one_buffer=True)["gbps"]
                    with progress.phase(f"{name}: fi_rma_bw, {pages} writes of {page_size} B",
                                        done=f"[green]✓[/green] {name}, fi_rma_bw run"):
                        try:  # the yardstick failing loses no row of ours
                            result["fi_rma_bw_gbps"] = run_fi_rma_bw(fi_rma_bw, name, page_size,
                                                                     pages).gbps
                        except ReferenceToolError as error:
                            result["fi_rma_bw_error"] = str(error)
                results.append(result)
            if messenger:
                shape = Shape()
                with progress.phase(f"{name}: the messengers' path, {shape.num_writes} writes "
                                    f"of {shape.write_bytes} B",
                                    done=f"[green]✓[/green] {name}, messengers' path measured"):
                    found = measure(name, shape, reps=3)
                results[-len(sizes)]["messenger"] = {
                    "writes": found["writes"], "write_bytes": found["write_bytes"],
                    **{f"us_per_write_{p}": v["us_per_write"] for p, v in found["paths"].items()},
                    **{k: found[k] for k in ("messenger_over_prepared", "verified")}}
    return results


def messenger_table(results: list[dict]) -> Table:
    table = Table(title="the messengers' KV path: a forward's writes, per write")
    for column in ("provider", "writes", "messenger µs", "ungrouped µs", "prepared µs",
                   "messenger / prepared", "verified"):
        table.add_column(column)
    for r in results:
        if "messenger" in r:
            m = r["messenger"]
            table.add_row(r["provider"], f"{m['writes']} x {m['write_bytes']} B",
                          *(f"{m[f'us_per_write_{p}']:.2f}"
                            for p in ("messenger", "ungrouped", "prepared")),
                          f"{m['messenger_over_prepared']:.2f}", str(m["verified"]))
    return table


def transfer_table(results: list[dict], page_size: int) -> Table:
    table = Table(title=f"transfer: pages of {page_size} B to shuffled slots")
    with_ref = any("fi_rma_bw_gbps" in r or "fi_rma_bw_error" in r for r in results)
    # "GB/s" waits for the receiver's count and ack; "sender GB/s" stops at the sender's own
    # completions, where the peers' harnesses stop (on tcp: sent, not yet placed).
    columns = ["provider", "pages", "GB/s", "sender GB/s", "µs/page", "4 KiB p50 µs",
               "4 KiB p99 µs", "verified"]
    ref_columns = ["fi_rma_bw GB/s", "ours / fi_rma_bw", "ours, one page GB/s",
                   "one page / fi_rma_bw"]
    for column in columns + (ref_columns if with_ref else []):
        table.add_column(column)
    for r in results:
        sender = r.get("gbps_initiator")
        row = [r["provider"], str(r["num_pages"]), f"{r['gbps']:.2f}",
               f"{sender:.2f}" if sender else "-", f"{r['us_per_page']:.2f}",
               f"{r['latency_us_p50']:.1f}", f"{r['latency_us_p99']:.1f}", str(r["verified"])]
        if with_ref:
            ref, one = r.get("fi_rma_bw_gbps"), r.get("one_buffer_gbps")
            row += [f"{ref:.2f}", f"{r['gbps'] / ref:.2f}"] if ref else ["-", "-"]
            row += [f"{one:.2f}" if one else "-", f"{one / ref:.2f}" if one and ref else "-"]
        table.add_row(*row)
    return table
