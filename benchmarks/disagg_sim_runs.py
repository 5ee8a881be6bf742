"""Turn a `benchmarks/disagg.py --json` result into the simulator's run records (S1 validation).

`disagg/sim/validate.py` replays a run (mode, layout, arrivals, measured percentiles) through
the simulator on the calibrated `cpu` preset. This file only translates: each served mode
becomes one record with the same arrivals and the percentiles the benchmark measured.
Run: `python benchmarks/disagg_sim_runs.py bench.json > runs.json`, then
`disagg calibrate --use-saved --no-validate --against runs.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# The benchmark's summary key and percentile for each metric the simulator predicts.
MEASURED = {"ttft_ms_p50": ("ttft_ms", "p50"), "ttft_ms_p99": ("ttft_ms", "p99"),
            "itl_ms_p50": ("itl_ms", "p50"), "itl_ms_p99": ("itl_ms", "p99"),
            "tps_per_request_p50": ("request_tokens_per_s", "p50")}


def arrival_time(request_id: str, workload: dict[str, Any]) -> float:
    """When `benchmarks/disagg.py`'s schedule sends a request: `short-i` at 50 ms steps from
    t=0, `long-i` from `first_long_s` every `interval_s` (its `make_schedule`).

    >>> arrival_time("long-2", {"first_long_s": 2.0, "interval_s": 2.5})
    7.0
    """
    kind, _, index = request_id.rpartition("-")
    if kind == "short":
        return 0.05 * int(index)
    if kind == "long":
        return float(workload["first_long_s"]) + int(index) * float(workload["interval_s"])
    raise ValueError(f"request id {request_id!r} is not from benchmarks/disagg.py's schedule")


def arrivals(mode: dict[str, Any], workload: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream as the simulator takes it, in arrival order. The output length is what the
    request really produced (a request stopped early by EOS decodes fewer steps)."""
    rows = [{"time": row.get("arrival_s", arrival_time(row["request_id"], workload)),
             "prompt_len": int(row["prompt_tokens"]), "output_len": int(row["output_tokens"])}
            for row in mode["per_request"] if row["output_tokens"] > 0]
    return sorted(rows, key=lambda a: a["time"])


def measured(mode: dict[str, Any]) -> dict[str, float]:
    """The benchmark's percentiles under the simulator's metric names (missing ones left out)."""
    out = {}
    for metric, (key, q) in MEASURED.items():
        value = mode.get(key, {}).get(q)
        if value is not None:
            out[metric] = float(value)
    return out


def sim_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One `disagg/sim/validate.py` run record per mode in a `benchmarks/disagg.py --json`
    result: mixed as one single-node engine per core, disagg as one prefiller and one decoder.
    """
    workload = result["workload"]
    runs = []
    for name, mode in result["modes"].items():
        run: dict[str, Any] = {"mode": name, "model": result["model"],
                               "chunk_size": int(workload["chunk_size"])}
        if name == "mixed":
            run["num_nodes"] = len(workload["cores"])
        else:
            run["prefillers"], run["decoders"] = 1, 1
        run["arrivals"] = arrivals(mode, workload)
        run["measured"] = measured(mode)
        runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> None:
    """Read a benchmark result (file or stdin), print the run records as one JSON list."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", nargs="?", help="benchmarks/disagg.py --json output "
                                                  "(default: stdin)")
    args = parser.parse_args(argv)
    text = Path(args.result).read_text() if args.result else sys.stdin.read()
    result = json.loads(text)
    sys.stdout.write(json.dumps(sim_runs(result), indent=1) + "\n")


if __name__ == "__main__":
    main()
