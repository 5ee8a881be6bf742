"""What a simulation measured: per-request timings and their summary (S9c's metrics).

TTFT is arrival to first token. TPS, the write-up's "tokens per second per request", is
output tokens after the first divided by the time from first to last token, so prefill
stalls in the middle of a stream count against it. Inter-token latency (ITL) is the gap
between consecutive steps that hand a request tokens: a prefill stall shows up as one long gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request's life in the simulator (times in seconds of simulated time)."""

    request_id: int
    arrival: float
    prompt_len: int
    output_len: int
    measured: bool = True  # arrived after the warm-up
    prefill_target: int = 0  # tokens the prefilling node computes
    prefilled: int = 0
    generated: int = 0
    prefill_start: float = math.nan
    kv_ready: float = math.nan
    first_token: float = math.nan
    last_token: float = math.nan
    finish: float = math.nan
    decoder: Any = None  # the decode instance that owns it (disaggregated mode)

    @property
    def ttft(self) -> float:
        """Seconds from arrival to the first token."""
        return self.first_token - self.arrival

    @property
    def tps(self) -> float:
        """Tokens per second while decoding (the tokens after the first)."""
        span = self.last_token - self.first_token
        return (self.generated - 1) / span if span > 0 else math.nan


def percentile(values: np.ndarray | list[float], q: float) -> float:
    """`q`-th percentile, NaN for no values."""
    array = np.asarray(values, dtype=float)
    array = array[~np.isnan(array)]
    return float(np.percentile(array, q)) if array.size else math.nan


@dataclass(slots=True)
class SimResult:
    """Measured requests, every inter-token gap, and per-instance counters."""

    requests: list[SimRequest]
    itl_gaps: np.ndarray
    instances: list[dict[str, object]] = field(default_factory=list)
    end_time: float = 0.0

    @property
    def finished(self) -> list[SimRequest]:
        """Measured requests that produced all their tokens."""
        return [r for r in self.requests if not math.isnan(r.finish)]

    def summary(self) -> dict[str, float | int]:
        """Percentiles of TTFT, TPS and ITL in ms and tokens/s, plus counts and utilisation."""
        done = self.finished
        ttft = [r.ttft for r in done]
        tps = [r.tps for r in done]
        gaps = self.itl_gaps
        decode_util = [float(i["utilisation"]) for i in self.instances  # type: ignore[arg-type]
                       if i["kind"] != "prefill"]
        prefill_util = [float(i["utilisation"]) for i in self.instances  # type: ignore[arg-type]
                        if i["kind"] == "prefill"]
        return {
            "requests": len(self.requests), "finished": len(done),
            "unfinished": len(self.requests) - len(done),
            "ttft_ms_p50": 1e3 * percentile(ttft, 50), "ttft_ms_p90": 1e3 * percentile(ttft, 90),
            "ttft_ms_p99": 1e3 * percentile(ttft, 99),
            "tps_per_request_p10": percentile(tps, 10), "tps_per_request_p50": percentile(tps, 50),
            "tps_per_request_p90": percentile(tps, 90),
            "itl_ms_p50": 1e3 * percentile(gaps, 50), "itl_ms_p99": 1e3 * percentile(gaps, 99),
            "itl_ms_max": 1e3 * float(gaps.max()) if gaps.size else math.nan,
            "stall_share": float((gaps > 5 * np.median(gaps)).mean()) if gaps.size else math.nan,
            "decode_utilisation": float(np.mean(decode_util)) if decode_util else math.nan,
            "prefill_utilisation": float(np.mean(prefill_util)) if prefill_util else math.nan,
        }
