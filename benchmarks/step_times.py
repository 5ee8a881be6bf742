"""The decoding nodes' own engine step times for `benchmarks/serving.py`, read from the Perfetto
files that `serve cluster --trace DIR` writes (DIR/<node>.json, at the nodes' exit).

Every node records a `step` span per engine step that ran a batch (`NodeBase._traced_step`): a
complete event ("X", `dur` in µs) whose args carry `num_tokens` and `num_seqs`. A step in which
every sequence contributed one token is a pure decode step (speculative decoding, off unless
`--speculative`, would make a decode contribute more); a step with more tokens than sequences
carried a prefill chunk (a mixed node's). Unlike the client's inter-token gaps, these times
leave out the network, the front door and the wait between steps. A mixed node's prefill chunk
of a single token is indistinguishable from a decode here and counts as one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from disagg_report import percentile

from disagg.utils.trace_merge import load_trace

STEP = "step"  # the span's name in `NodeBase._traced_step`


def step_stats(durations_ms: list[float]) -> dict[str, float | int | None]:
    """How many steps, and their p50 / p90 (nearest rank: a time a step took)."""
    return {"steps": len(durations_ms), "p50": percentile(durations_ms, 50),
            "p90": percentile(durations_ms, 90)}


def step_summary(events: Iterable[dict[str, Any]], since_us: float | None = None
                 ) -> dict[str, Any]:
    """Step times (ms) from trace events: pure-decode steps by batch size (`num_seqs`, as a
    string key, as JSON has it), and apart from them the steps that carried a prefill chunk.
    Steps that began before `since_us` (epoch µs: the warm-up, say) are left out."""
    by_batch: dict[int, list[float]] = {}
    with_prefill: list[float] = []
    for event in events:
        if event.get("name") != STEP or event.get("ph") != "X":
            continue
        if since_us is not None and event["ts"] < since_us:
            continue
        args, ms = event.get("args", {}), event["dur"] / 1e3
        tokens, seqs = int(args["num_tokens"]), int(args["num_seqs"])
        if tokens == seqs:
            by_batch.setdefault(seqs, []).append(ms)
        else:
            with_prefill.append(ms)
    return {"decode_step_ms_by_batch": {str(n): step_stats(by_batch[n])
                                        for n in sorted(by_batch)},
            "mixed_step_ms": step_stats(with_prefill)}


def read_events(paths: Iterable[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every trace event of the files at `paths`, and the names of those missing (a node that
    was killed, not stopped, writes none)."""
    events: list[dict[str, Any]] = []
    missing: list[str] = []
    for path in paths:
        try:
            events += load_trace(path)
        except FileNotFoundError:
            missing.append(path.name)
    return events, missing
