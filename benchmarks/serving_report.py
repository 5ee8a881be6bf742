"""Numbers and the table for `benchmarks/serving.py`: TTFT, inter-token latency, requests/s and
tokens/s per serving mode, from what the HTTP client saw, and the decoding nodes' own step
times as `step_times.py` read them from their traces (pure functions, no processes).

Percentiles are nearest-rank (`disagg_report.percentile`): a p99 is a latency that happened.
Times are the client's: a token's time is when the stream chunk carrying it arrived, so tokens
sharing a chunk are 0 ms apart (`multi_token_chunks` counts how often that happened).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from disagg_report import ITL_GOAL, _ratio, percentile, spread, steady_window
from step_times import step_summary

if TYPE_CHECKING:
    from rich.table import Table


def request_row(o: Any) -> dict[str, Any]:  # noqa: ANN401 - a serving.Observed
    """One request: its shape, TTFT (from when it was sent), gaps, end to end, outcome."""
    times = o.token_times
    return {"at_s": o.arrival.at_s, "kind": o.arrival.kind,
            "prompt_tokens": len(o.arrival.prompt), "max_tokens": o.arrival.max_tokens,
            "send_lag_ms": (o.sent - o.arrival.at_s) * 1e3,
            "ttft_ms": (times[0] - o.sent) * 1e3 if times else None,
            "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)],
            "e2e_ms": (o.end - o.sent) * 1e3, "output_tokens": len(times),
            "chunks": o.chunks, "usage_tokens": o.usage_tokens,
            "finish_reason": o.finish_reason, "error": o.error,
            "ok": o.error is None and o.finish_reason is not None}


def itl_by_decoding(observed: list[Any]) -> dict[int, dict[str, float | None]]:
    """Gaps grouped by how many requests were decoding (between their first and last token,
    as the client saw them) at the gap's midpoint: a decode step's time grows with its batch,
    so this separates batch-size spread from stalls. Counts every node together."""
    spans = [(o.token_times[0], o.token_times[-1]) for o in observed if o.token_times]
    groups: dict[int, list[float]] = {}
    for o in observed:
        for a, b in zip(o.token_times, o.token_times[1:], strict=False):
            mid = (a + b) / 2
            groups.setdefault(sum(s <= mid <= e for s, e in spans), []).append((b - a) * 1e3)
    return {n: {"gaps": len(v)} | spread(v) for n, v in sorted(groups.items())}


def steady_itl(observed: list[Any]) -> tuple[list[float], list[float]]:
    """Gaps (ms) inside the in-process benchmark's steady window (`disagg_report.steady_window`:
    from the first long prompt's first token to the last one's), and that window (s)."""
    ok = [o for o in observed if o.error is None and o.token_times]
    low, high = steady_window({"observed": ok, "start": 0.0,
                               "end": max((o.end for o in ok), default=0.0)})
    gaps = [(b - a) * 1e3 for o in ok for a, b in zip(o.token_times, o.token_times[1:],
                                                       strict=False) if a >= low and b <= high]
    return gaps, [low, high]


def mode_summary(run: dict[str, Any]) -> dict[str, Any]:
    """Every number one mode reports."""
    rows = [request_row(o) for o in run["observed"]]
    done = [r for r in rows if r["ok"]]
    itl = [gap for r in done for gap in r["itl_ms"]]
    itl_spread = spread(itl, with_max=True)
    steady, window = steady_itl(run["observed"])
    steady_spread = spread(steady, with_max=True)
    tokens = sum(r["output_tokens"] for r in done)
    # From the first arrival to the last request's end: idle time in the stream counts.
    duration = max((o.end for o in run["observed"]), default=0.0)
    quiet = run["quiet"]
    return {
        "requested": len(rows), "completed": len(done), "failed": len(rows) - len(done),
        "finished_early": sum(r["output_tokens"] < r["max_tokens"] for r in done),
        "expected_tokens": sum(r["max_tokens"] for r in done), "output_tokens": tokens,
        "usage_mismatches": sum(r["usage_tokens"] != r["output_tokens"] for r in done),
        "multi_token_chunks": sum(r["output_tokens"] > r["chunks"] for r in done),
        "duration_s": duration,
        "requests_per_s": len(done) / duration if duration else None,
        "output_tokens_per_s": tokens / duration if duration else None,
        "ttft_ms": spread([r["ttft_ms"] for r in done]),
        "ttft_short_ms": spread([r["ttft_ms"] for r in done if r["kind"] == "short"]),
        "ttft_long_ms": spread([r["ttft_ms"] for r in done if r["kind"] == "long"]),
        "itl_ms": itl_spread, "itl_p99_over_p50": _ratio(itl_spread["p99"], itl_spread["p50"]),
        "steady_window_s": window, "steady_itl_ms": steady_spread,
        "steady_itl_p99_over_p50": _ratio(steady_spread["p99"], steady_spread["p50"]),
        "e2e_ms": spread([r["e2e_ms"] for r in done]),
        "itl_by_decoding_ms": itl_by_decoding([o for o, r in zip(run["observed"], rows,
                                                                  strict=True) if r["ok"]]),
        "send_lag_ms_max": max((r["send_lag_ms"] for r in rows), default=None),
        "quiet_machine": quiet.quiet, "others_busy_before": quiet.others,
        **engine_steps(run),
        "cpu_cores": run["cpu_cores"], "affinity": run["affinity"],
        "server_exit_code": run["server_exit_code"], "server_log_tail": run["server_log_tail"],
        "errors": sorted({r["error"] for r in rows if r["error"]})[:5],
        "per_request": [{k: v for k, v in r.items() if k != "itl_ms"}
                        | {"itl_ms_max": max(r["itl_ms"], default=None)} for r in rows]}


def engine_steps(run: dict[str, Any]) -> dict[str, Any]:
    """The run's step times (`step_times.step_summary`); none for a run that read no traces."""
    return run.get("engine_steps") or step_summary([]) | {"step_traces_missing": []}


def summarize(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON object: workload, machine, each mode, and the issue's ITL goal."""
    modes = {mode: mode_summary(run) for mode, run in runs.items()}
    workload = {k: str(v) if k == "out" else v for k, v in vars(args).items()
                if k not in ("json", "modes")}
    result: dict[str, Any] = {
        "model": args.model, "workload": workload,
        "machine": {"cpus": os.cpu_count(),
                    "note": "two nodes pinned one per core; the front door process and the "
                            "client are not pinned and share those cores"},
        "modes": modes}
    if "disagg" in modes:
        # Read where the in-process benchmark reads it: its steady window, on its schedule.
        key = "steady_itl_p99_over_p50" if args.stream == "steady" else "itl_p99_over_p50"
        ratio = modes["disagg"][key]
        result["goal"] = {"window": "steady" if args.stream == "steady" else "all",
                          "disagg_itl_p99_over_p50": ratio, "target": ITL_GOAL,
                          "met": ratio is not None and ratio <= ITL_GOAL,
                          "mixed_itl_p99_over_p50": modes.get("mixed", {}).get(key)}
    return result


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def step_table(modes: dict[str, dict[str, Any]]) -> Table:
    """The decoding nodes' engine step times: a row per decode batch size, then the steps that
    carried a prefill chunk; each cell "steps, p50 / p90" ms."""
    from rich.table import Table

    def cell(stats: dict[str, Any] | None) -> str:
        if not stats or not stats["steps"]:
            return "-"
        return f"{stats['steps']}, {_n(stats['p50'], 1)} / {_n(stats['p90'], 1)}"

    table = Table(title="Engine step ms per batch: steps, p50 / p90")
    table.add_column("batch")
    for mode in modes:
        table.add_column(mode, justify="right")
    batches = {int(n) for m in modes.values() for n in m.get("decode_step_ms_by_batch", {})}
    for n in sorted(batches):
        table.add_row(str(n), *[cell(m.get("decode_step_ms_by_batch", {}).get(str(n)))
                                for m in modes.values()])
    table.add_row("with a prefill chunk", *[cell(m.get("mixed_step_ms")) for m in modes.values()])
    return table


def print_table(result: dict[str, Any]) -> None:
    """One rich table, a column per mode, then the goal line."""
    from rich.console import Console
    from rich.table import Table

    modes, w = result["modes"], result["workload"]
    title = (f"{w['num_requests']} requests, Poisson {w['rate']}/s, {w['long_fraction']:.0%} "
             f"long ({w['long_len'][0]}-{w['long_len'][1]} tokens), {w['max_tokens']} tokens "
             "each") if w.get("stream", "poisson") == "poisson" else (
        "the in-process benchmark's steady schedule")
    table = Table(title=f"{result['model']} over HTTP: {title}")
    table.add_column("metric")
    for mode in modes:
        table.add_column(mode, justify="right")

    def row(label: str, get: Any) -> None:  # noqa: ANN401
        table.add_row(label, *[get(m) for m in modes.values()])

    def pair(values: dict[str, Any], digits: int = 0, keys: tuple[str, ...] = ("p50", "p99")
             ) -> str:
        return " / ".join(_n(values[k], digits) for k in keys)

    row("quiet before (others' CPU)",
        lambda m: f"{m['quiet_machine']} ({m['others_busy_before']:.0%})")
    row("requests: done / asked (failed)",
        lambda m: f"{m['completed']} / {m['requested']} ({m['failed']})")
    row("output tokens / expected", lambda m: f"{m['output_tokens']} / {m['expected_tokens']}")
    row("requests/s", lambda m: _n(m["requests_per_s"], 3))
    row("output tokens/s", lambda m: _n(m["output_tokens_per_s"], 1))
    row("TTFT ms p50 / p99", lambda m: pair(m["ttft_ms"]))
    row("  short prompts", lambda m: pair(m["ttft_short_ms"]))
    row("  long prompts", lambda m: pair(m["ttft_long_ms"]))
    row("ITL ms p50 / p99 / max", lambda m: pair(m["itl_ms"], 1, ("p50", "p99", "max")))
    row("ITL p99 / p50", lambda m: _n(m["itl_p99_over_p50"], 2))
    row("steady window: ITL ms p50 / p99 (ratio)", lambda m: f"{pair(m['steady_itl_ms'], 1)} "
                                                            f"({_n(m['steady_itl_p99_over_p50'], 2)})")
    row("end to end ms p50 / p99", lambda m: pair(m["e2e_ms"]))
    row("requests with multi-token chunks", lambda m: str(m["multi_token_chunks"]))
    row("CPU cores: nodes", lambda m: " + ".join(
        f"{v:.2f}" for k, v in m["cpu_cores"].items() if k not in ("front door", "client",
                                                                   "others")))
    row("CPU cores: front door / client / others", lambda m: " / ".join(
        f"{m['cpu_cores'][k]:.2f}" for k in ("front door", "client", "others")))
    row("server exit code", lambda m: str(m["server_exit_code"]))
    console = Console(width=max(Console().width, 110))
    console.print(table)
    by_batch = Table(title="ITL by requests decoding at the time: gaps, ms p50 / p99")
    by_batch.add_column("decoding")
    for mode in modes:
        by_batch.add_column(mode, justify="right")
    for n in sorted({int(k) for m in modes.values() for k in m["itl_by_decoding_ms"]}):
        cells = []
        for m in modes.values():
            groups = m["itl_by_decoding_ms"]
            stats = groups.get(n, groups.get(str(n)))  # int keys become str in JSON
            cells.append("-" if stats is None else f"{stats['gaps']}, {pair(stats, 1)}")
        by_batch.add_row(str(n), *cells)
    console.print(by_batch)
    console.print(step_table(modes))
    goal = result.get("goal")
    if goal:
        verdict = "met" if goal["met"] else "NOT met"
        console.print(f"goal (disagg ITL p99 <= {goal['target']}x p50, {goal['window']} gaps): "
                      f"{verdict} "
                      f"({_n(goal['disagg_itl_p99_over_p50'], 2)}x; mixed "
                      f"{_n(goal['mixed_itl_p99_over_p50'], 2)}x)")
