"""Numbers and tables for `benchmarks/disagg.py`: TTFT, inter-token latency, tokens/s, and the
TTFT split of a disaggregated request into queueing, prefill and transfer tail (S1, S3).

Pure functions over what the benchmark recorded (router event times, node trace events); no
processes here. Percentiles are nearest-rank, so a p99 is a latency that really happened.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict
from typing import Any

ITL_GOAL = 1.3  # S2: disaggregated decode ITL p99 within 1.3x of its median
DISTURBED = 0.05  # other processes above this share of the machine (a tenth of a core) count


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (`q` in [0, 100]); None for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99)
    (2.0, 4.0)
    """
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def spread(values: list[float], *, with_max: bool = False) -> dict[str, float | None]:
    """p50 and p99 (and max) of `values`."""
    out = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    if with_max:
        out["max"] = max(values) if values else None
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def steady_window(run: dict[str, Any]) -> tuple[float, float]:
    """From the first long prompt's first token to the last one's: long prompts keep being
    prefilled and joining the decode batch all along, and the warm-up (only short requests
    decoding, small batches) and the drain are left out."""
    firsts = [o.token_times[0] for o in run["observed"]
              if o.arrival.kind == "long" and o.token_times]
    return (min(firsts), max(firsts)) if len(firsts) > 1 else (run["start"], run["end"])


def request_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per request: TTFT, gaps between tokens (all, and inside `steady_window`), decode
    tokens/s (ms and tokens/s)."""
    rows = []
    low, high = steady_window(run)
    busy = [(s, e) for s, e, share in run.get("others_cpu", []) if share > DISTURBED]
    for o in run["observed"]:
        times = o.token_times
        pairs = list(zip(times, times[1:], strict=False))
        gaps = [(b - a) * 1e3 for a, b in pairs]
        steady = [(b - a) * 1e3 for a, b in pairs if a >= low and b <= high]
        undisturbed = [(b - a) * 1e3 for a, b in pairs if a >= low and b <= high
                       and not any(s < b and a < e for s, e in busy)]
        rows.append({
            "request_id": o.arrival.request_id, "kind": o.arrival.kind, "node": o.node,
            "state": o.state.value, "prompt_tokens": len(o.arrival.prompt_token_ids),
            "output_tokens": len(times),
            "ttft_ms": (times[0] - o.submitted_at) * 1e3 if times else None,
            "itl_ms": gaps, "steady_itl_ms": steady, "undisturbed_itl_ms": undisturbed,
            "tokens_per_s": (len(times) - 1) / (times[-1] - times[0])
            if len(times) > 1 and times[-1] > times[0] else None})
    return rows


def step_stats(traces: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Engine step times of the nodes that decode, split by whether a prefill chunk rode
    along (a step with more tokens than sequences holds part of a prompt)."""
    decode_only, with_prefill = [], []
    by_seqs: dict[int, list[float]] = defaultdict(list)  # decode-only steps by batch size
    for node, events in traces.items():
        if node.startswith("prefill"):
            continue
        for e in events:
            if e.get("name") == "step" and e.get("ph") == "X":
                args = e.get("args", {})
                prefill = args.get("num_tokens", 0) > args.get("num_seqs", 0)
                (with_prefill if prefill else decode_only).append(e["dur"] / 1e3)
                if not prefill:
                    by_seqs[args.get("num_seqs", 0)].append(e["dur"] / 1e3)
    return {"decode_only_ms": spread(decode_only, with_max=True),
            "with_prefill_ms": spread(with_prefill, with_max=True),
            "num_decode_only": len(decode_only), "num_with_prefill": len(with_prefill),
            "decode_only_by_num_seqs": {n: {"steps": len(v)} | spread(v)
                                        for n, v in sorted(by_seqs.items())}}


def ttft_split(run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where a disaggregated request's TTFT went, from the prefiller's trace: `queue`
    (KVRequest received -> first chunk scheduled), `prefill` (-> last layer's writes posted),
    `transfer_tail` (-> every write completed), and `rest` (routing, the decoder noticing its
    counter, the first decode step, the event back). p50 and mean per part, long prompts."""
    spans: dict[str, dict[str, float]] = defaultdict(dict)
    for node, events in run["traces"].items():
        if not node.startswith("prefill"):
            continue
        for e in events:
            if e.get("ph") == "X" and e["name"] in ("queue", "prefill", "transfer_tail"):
                spans[e["args"]["request_id"]][e["name"]] = e["dur"] / 1e3
    if not spans:
        return None
    parts: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        split = spans.get(row["request_id"])
        if row["kind"] != "long" or split is None or row["ttft_ms"] is None:
            continue
        for name in ("queue", "prefill", "transfer_tail"):
            parts[name].append(split.get(name, 0.0))
        parts["rest"].append(row["ttft_ms"] - sum(split.values()))
        parts["ttft"].append(row["ttft_ms"])
    return {name: {"p50": percentile(values, 50), "mean": sum(values) / len(values)}
            for name, values in parts.items()}


def mode_summary(run: dict[str, Any]) -> dict[str, Any]:
    """Every number one mode reports."""
    rows = request_rows(run)
    itl = [gap for row in rows for gap in row["itl_ms"]]
    steady = [gap for row in rows for gap in row["steady_itl_ms"]]
    undisturbed = [gap for row in rows for gap in row["undisturbed_itl_ms"]]
    calm = spread(undisturbed)
    low, high = steady_window(run)
    tokens = sum(row["output_tokens"] for row in rows)
    wall = run["end"] - run["start"]
    itl_spread = spread(itl, with_max=True)
    steady_spread = spread(steady, with_max=True)
    quiet = run["quiet"]
    summary = {
        "quiet_machine": quiet.quiet, "others_busy_before": quiet.others,
        "ours_idle_before": quiet.ours, "quiet_wait_s": quiet.waited_s,
        "cpu_during_run": run["cpu"], "affinity": run["affinity"],
        "requests": len(rows),
        "failed": sum(row["state"] in ("failed", "finished_failed") for row in rows),
        "finished_early": sum(row["state"] == "finished_stopped" for row in rows),
        "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "ttft_ms": spread([r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]),
        "ttft_long_ms": spread([r["ttft_ms"] for r in rows
                                if r["kind"] == "long" and r["ttft_ms"] is not None]),
        "itl_ms": itl_spread, "itl_p99_over_p50": _ratio(itl_spread["p99"], itl_spread["p50"]),
        "steady_window_s": [low - run["start"], high - run["start"]],
        "steady_itl_ms": steady_spread,
        "steady_itl_p99_over_p50": _ratio(steady_spread["p99"], steady_spread["p50"]),
        # The same, leaving out gaps during which other processes used the cores.
        "undisturbed_itl_ms": calm, "undisturbed_itl_p99_over_p50": _ratio(calm["p99"],
                                                                           calm["p50"]),
        "disturbed_gap_share": 1 - len(undisturbed) / len(steady) if steady else None,
        "others_cpu_max": max((share for *_, share in run.get("others_cpu", [])), default=None),
        "request_tokens_per_s": {
            "p50": percentile([r["tokens_per_s"] for r in rows if r["tokens_per_s"]], 50),
            "min": min((r["tokens_per_s"] for r in rows if r["tokens_per_s"]), default=None)},
        "steps": step_stats(run["traces"]),
        "ttft_split_ms": ttft_split(run, rows),
        "per_request": [{k: v for k, v in row.items()
                         if k not in ("itl_ms", "steady_itl_ms", "undisturbed_itl_ms")}
                        | {"itl_ms_max": max(row["itl_ms"], default=None)} for row in rows]}
    return summary


def summarize(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The `--json` object: workload, machine, each mode, and the issue's ITL goal."""
    import torch

    modes = {mode: mode_summary(run) for mode, run in runs.items()}
    workload = {k: v for k, v in vars(args).items() if k not in ("json", "modes")}
    result: dict[str, Any] = {"model": args.model, "workload": workload,
                              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
                              "modes": modes}
    if "disagg" in modes:
        ratio = modes["disagg"]["steady_itl_p99_over_p50"]
        result["goal"] = {"window": "steady", "disagg_itl_p99_over_p50": ratio,
                          "target": ITL_GOAL, "met": ratio is not None and ratio <= ITL_GOAL,
                          "mixed_itl_p99_over_p50": modes.get("mixed", {}).get(
                              "steady_itl_p99_over_p50")}
    return result


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100


def print_tables(result: dict[str, Any]) -> None:
    """The rich tables: mixed vs disagg side by side, then the TTFT split."""
    from rich.console import Console
    from rich.table import Table

    modes = result["modes"]
    w = result["workload"]
    table = Table(title=f"{result['model']}: {w['num_short']} short prompts x "
                        f"{w['short_max_tokens']} tokens, then {w['num_long']} prompts of "
                        f"{w['long_prompt_len']} tokens every {w['interval_s']} s")
    table.add_column("metric")
    for mode in modes:
        table.add_column(mode, justify="right")

    def row(label: str, get: Any) -> None:
        table.add_row(label, *[get(m) for m in modes.values()])

    def parts(values: dict[str, Any], keys: tuple[str, ...], digits: int = 0) -> str:
        return " / ".join(_ms(values[key], digits) for key in keys)

    row("quiet before (others' CPU)",
        lambda m: f"{m['quiet_machine']} ({m['others_busy_before']:.0%})")
    row("CPU: ours / others", lambda m: f"{m['cpu_during_run']['ours']:.0%} / "
                                         f"{m['cpu_during_run']['others']:.0%}")
    row("requests (failed)", lambda m: f"{m['requests']} ({m['failed']})")
    row("output tokens / wall s", lambda m: f"{m['output_tokens']} / {m['wall_s']:.1f}")
    row("tokens/s overall", lambda m: f"{m['tokens_per_s']:.1f}")
    row("tokens/s per request p50 / min",
        lambda m: parts(m["request_tokens_per_s"], ("p50", "min"), 1))
    row("TTFT ms p50 / p99 (all)", lambda m: parts(m["ttft_ms"], ("p50", "p99")))
    row("TTFT ms p50 / p99 (long)", lambda m: parts(m["ttft_long_ms"], ("p50", "p99")))
    row("ITL ms p50 / p99 / max", lambda m: parts(m["itl_ms"], ("p50", "p99", "max"), 1))
    row("ITL p99 / p50", lambda m: _ms(m["itl_p99_over_p50"], 2))
    row("steady window s", lambda m: f"{m['steady_window_s'][0]:.1f} - "
                                     f"{m['steady_window_s'][1]:.1f}")
    row("steady ITL ms p50 / p99 / max",
        lambda m: parts(m["steady_itl_ms"], ("p50", "p99", "max"), 1))
    row("steady ITL p99 / p50", lambda m: _ms(m["steady_itl_p99_over_p50"], 2))
    row("  undisturbed: p50 / p99 ms, ratio",
        lambda m: parts(m["undisturbed_itl_ms"], ("p50", "p99"), 1)
        + f", {_ms(m['undisturbed_itl_p99_over_p50'], 2)}")
    row("  gaps left out (others' CPU max)",
        lambda m: f"{_ms(_pct(m['disturbed_gap_share']))}% ({_ms(_pct(m['others_cpu_max']))}%)")
    row("decode-only steps: n, ms p50 / p99", lambda m: f"{m['steps']['num_decode_only']}, "
        + parts(m["steps"]["decode_only_ms"], ("p50", "p99"), 1))
    row("steps with a prefill chunk: n, ms p50", lambda m: f"{m['steps']['num_with_prefill']}, "
        + parts(m["steps"]["with_prefill_ms"], ("p50",)))
    console = Console()
    console.print(table)
    by_seqs = Table(title="decode-only steps by batch size: count, ms p50 / p99")
    by_seqs.add_column("requests in step")
    for mode in modes:
        by_seqs.add_column(mode, justify="right")
    sizes = sorted({int(n) for m in modes.values()
                    for n in m["steps"]["decode_only_by_num_seqs"]})
    for size in sizes:
        cells = []
        for m in modes.values():
            stats = m["steps"]["decode_only_by_num_seqs"]
            stats = stats.get(size, stats.get(str(size)))  # int keys become str in JSON
            cells.append("-" if stats is None else
                         f"{stats['steps']}, {parts(stats, ('p50', 'p99'), 1)}")
        by_seqs.add_row(str(size), *cells)
    console.print(by_seqs)
    split = modes.get("disagg", {}).get("ttft_split_ms")
    if split:
        parts = Table(title="disagg TTFT of the long prompts, split (ms)")
        for column in ("part", "p50", "mean"):
            parts.add_column(column, justify="right" if column != "part" else "left")
        labels = {"queue": "queue at prefiller", "prefill": "prefill (to last layer posted)",
                  "transfer_tail": "transfer tail", "rest": "rest (router, decoder, 1st step)",
                  "ttft": "TTFT"}
        for name, label in labels.items():
            if name in split:
                parts.add_row(label, _ms(split[name]["p50"], 1), _ms(split[name]["mean"], 1))
        console.print(parts)
    goal = result.get("goal")
    if goal:
        verdict = "met" if goal["met"] else "NOT met"
        console.print(f"goal (disagg steady ITL p99 <= {goal['target']}x p50): {verdict} "
                      f"({_ms(goal['disagg_itl_p99_over_p50'], 3)}x; mixed "
                      f"{_ms(goal['mixed_itl_p99_over_p50'], 2)}x)")
