"""The live view of `disagg demo`: one row per request, updated as events arrive (rich), down
to 80 columns (S1, S2, X7c)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from disagg.apps.demo import DemoRequest
from disagg.engine.request import RequestState

STATE_STYLE = {RequestState.WAITING: "dim", RequestState.WAITING_FOR_KV: "yellow",
               RequestState.RUNNING: "cyan", RequestState.FINISHED_STOPPED: "green",
               RequestState.FINISHED_LENGTH: "green", RequestState.FINISHED_FAILED: "red"}


NARROW = 110  # below this many columns, short headers and the text's latest words only


def request_table(requests: list[DemoRequest], title: str = "disaggregated serving",
                  width: int | None = None) -> Table:
    """A table of every request: state, KV progress, TTFT, tokens/s and text so far. The
    figures keep their width and the text takes what is left of `width` (80 columns and up
    stay readable), showing its end: the tokens that just arrived."""
    narrow = width is not None and width < NARROW
    table = Table(title=title, expand=True, padding=(0, 1 if not narrow else 0))
    headers = (("req", "dec", "state", "KV", "TTFT", "tok/s", "text") if narrow else
               ("request", "dec", "state", "KV writes", "TTFT ms", "tok/s", "text"))
    for column, justify in zip(headers, ("left", "right", "left", "right", "right", "right",
                                         "left"), strict=True):
        table.add_column(column, justify=justify, no_wrap=True,  # type: ignore[arg-type]
                         overflow="ellipsis", ratio=1 if column == "text" else None,
                         min_width=8 if column == "text" else None)
    keep = max(8, width - 45) if narrow and width is not None else 60  # text characters
    for r in requests:
        kv = f"{r.kv_writes}" if r.kv_writes else (
            f"{r.kv_writes_received}…" if r.kv_writes_received else "")
        tps = f"{1e3 / r.tpot_ms:.1f}" if r.tpot_ms else ""
        ttft = f"{r.ttft_ms:.0f}" if r.ttft_ms is not None else ""
        text = r.text if r.stream is not None else " ".join(map(str, r.token_ids))
        state = r.state.value.removeprefix("finished_")
        table.add_row(r.request_id, str(r.decoder), f"[{STATE_STYLE.get(r.state, '')}]{state}",
                      kv, ttft, tps, text[-keep:].replace("\n", " "))
    return table


def totals_table(result: dict[str, Any]) -> Table:
    """The run's totals: requests, tokens, throughput, TTFT, KV moved (pages in the cache's
    dtype, which the title names)."""
    t = result["totals"]
    table = Table(title=f"totals (KV in {result.get('kv_dtype', 'float32')})")
    for column in ("requests", "failed", "tokens", "tok/s", "TTFT p50 ms", "KV writes", "KV MiB"):
        table.add_column(column, justify="right")
    ttft = f"{t['ttft_ms_p50']:.0f}" if t["ttft_ms_p50"] is not None else "-"
    table.add_row(str(t["requests"]), str(t["failed"]), str(t["output_tokens"]),
                  f"{t['tokens_per_s']:.1f}", ttft, str(t["kv_writes"]),
                  f"{t['kv_bytes'] / 2**20:.1f}")
    return table


def metrics_table(metrics: dict[str, dict[str, float]]) -> Table:
    """A few of each node's metrics: transfers, failures, leases, pages still in use."""
    table = Table(title="node metrics")
    for column in ("node", "KV writes", "KV MiB", "failures", "expired leases",
                   "pages in use"):
        table.add_column(column, justify="right")
    for node, values in sorted(metrics.items()):
        def total(prefix: str, values: dict[str, float] = values) -> float:
            return sum(v for k, v in values.items() if k.startswith(prefix))
        # A decoder counts what it received, a prefiller what it sent: one of each is 0.
        writes = total("disagg:kv_writes_total") or total("disagg:kv_sent_writes_total")
        nbytes = total("disagg:kv_bytes_total") or total("disagg:kv_sent_bytes_total")
        failures = total("disagg:failures_total") + total("disagg:kv_send_failures_total")
        table.add_row(node, f"{writes:.0f}", f"{nbytes / 2**20:.2f}", f"{failures:.0f}",
                      f"{total('disagg:kv_expired_leases_total'):.0f}",
                      f"{total('disagg:kv_pages_in_use'):.0f}")
    return table
