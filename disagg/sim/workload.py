"""Request streams for the cluster simulator: Poisson arrivals or a trace (S1, S9c).

Prompt and output lengths are lognormal around their means (sigma 0 gives fixed lengths).
The default means, 8,192 prompt tokens and 1,024 output tokens, are the "8k/1k" scenario of
public inference benchmarks (SemiAnalysis InferenceMAX), a stand-in for search-augmented
answers: the Perplexity write-up does not publish its length distribution.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disagg.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Workload:
    """What arrives: `qps` requests per second for `duration_s`, lengths around the means."""

    qps: float = 3.0
    prompt_len: int = 8192
    output_len: int = 1024
    length_sigma: float = 0.3
    duration_s: float = 240.0
    warmup_s: float = 30.0  # requests arriving earlier are served but not measured
    seed: int = 0
    max_prompt_len: int = 65536

    def __post_init__(self) -> None:
        if self.qps <= 0:
            raise ConfigError(f"qps must be positive, got {self.qps}")
        if self.prompt_len < 2 or self.output_len < 2:
            raise ConfigError("prompt_len and output_len must be at least 2 tokens, got "
                              f"{self.prompt_len} and {self.output_len}")
        if self.length_sigma < 0:
            raise ConfigError(f"length_sigma must be >= 0, got {self.length_sigma}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ConfigError(f"need 0 <= warmup_s < duration_s, got {self.warmup_s} and "
                              f"{self.duration_s}")


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the stream."""

    time: float
    prompt_len: int
    output_len: int


def _lognormal(rng: np.random.Generator, mean: int, sigma: float, size: int,
               upper: int) -> np.ndarray:
    if sigma == 0:
        return np.full(size, mean, dtype=np.int64)
    mu = math.log(mean) - sigma**2 / 2  # keeps the mean at `mean`
    return np.clip(np.rint(rng.lognormal(mu, sigma, size)), 2, upper).astype(np.int64)


def poisson_arrivals(workload: Workload) -> list[Arrival]:
    """A seeded Poisson stream over `duration_s`: the same seed gives the same list."""
    rng = np.random.default_rng(workload.seed)
    expected = int(workload.qps * workload.duration_s * 1.5) + 16
    times = np.cumsum(rng.exponential(1.0 / workload.qps, expected))
    times = times[times < workload.duration_s]
    prompts = _lognormal(rng, workload.prompt_len, workload.length_sigma, len(times),
                         workload.max_prompt_len)
    outputs = _lognormal(rng, workload.output_len, workload.length_sigma, len(times),
                         8 * workload.output_len)
    return [Arrival(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs,
                                                                  strict=True)]


def load_trace(path: Path) -> list[Arrival]:
    """A trace file: one JSON object per line with `time`, `prompt_len`, `output_len`."""
    arrivals = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            arrival = Arrival(float(item["time"]), int(item["prompt_len"]),
                              int(item["output_len"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"{path}:{number}: not a trace record ({error})") from error
        if arrival.prompt_len < 2 or arrival.output_len < 2 or arrival.time < 0:
            raise ConfigError(f"{path}:{number}: lengths must be >= 2 and time >= 0")
        arrivals.append(arrival)
    if not arrivals:
        raise ConfigError(f"trace {path} is empty")
    return sorted(arrivals, key=lambda a: a.time)
