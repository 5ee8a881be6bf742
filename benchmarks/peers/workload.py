"""The peer transfer workload, shared by the peer harnesses (measurement only, not project code).

2048 pages of 64 KiB written from one process into a seeded random permutation of page slots
of another process's registered region, checked by a hash of the whole destination; plus a
single 4 KiB write latency distribution. This is the same workload as `benchmarks/transfer.py`
(S5), so the numbers line up with ours. Runs in `.venv-peers` (numpy only, no torch)
and is never imported by `disagg` or `transfer_core`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

LATENCY_BYTES = 4096


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    pages: int = 2048
    page_bytes: int = 64 * 1024
    seed: int = 0
    warmup: int = 3
    iters: int = 10
    latency_iters: int = 1000

    def __post_init__(self) -> None:
        if self.pages < 1 or self.page_bytes < LATENCY_BYTES:
            raise ValueError(f"need pages >= 1 and page_bytes >= {LATENCY_BYTES}: {self}")
        if self.iters < 1 or self.latency_iters < 1 or self.warmup < 0:
            raise ValueError(f"need iters, latency_iters >= 1 and warmup >= 0: {self}")

    @property
    def region_bytes(self) -> int:
        return self.pages * self.page_bytes


@dataclass(slots=True)
class PeerResult:
    """One run of one peer engine; `to_json` is the line the harness prints."""

    engine: str
    transport: str
    gbps: float
    us_per_page: float
    latency_us_p50: float
    latency_us_p99: float
    verified: bool
    pages: int
    page_bytes: int
    batch_gbps_all: list[float] = field(default_factory=list)
    config: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def make_source(cfg: WorkloadConfig) -> np.ndarray:
    """Seeded random bytes, one row per page."""
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(0, 256, size=(cfg.pages, cfg.page_bytes), dtype=np.uint8)


def make_permutation(cfg: WorkloadConfig) -> np.ndarray:
    """Destination slot of source page i is perm[i] (seeded, separate stream from the data)."""
    return np.random.default_rng(cfg.seed + 1).permutation(cfg.pages)


def region_digest(region: np.ndarray) -> str:
    # A position-sensitive hash: a plain sum would accept pages landing in the wrong slots.
    return hashlib.blake2b(memoryview(np.ascontiguousarray(region)).cast("B")).hexdigest()


def expected_digest(src: np.ndarray, perm: np.ndarray) -> str:
    expected = np.empty_like(src)
    expected[perm] = src
    return region_digest(expected)


def page_offsets(cfg: WorkloadConfig, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets (source, destination) of every page write, in submit order."""
    src = np.arange(cfg.pages, dtype=np.int64) * cfg.page_bytes
    dst = perm.astype(np.int64) * cfg.page_bytes
    return src, dst


def latency_offsets(cfg: WorkloadConfig, perm: np.ndarray) -> tuple[int, int]:
    """The 4 KiB latency write re-sends the head of page 0 to where it already landed, so the
    destination digest does not depend on whether latency runs before or after verification."""
    return 0, int(perm[0]) * cfg.page_bytes


def summarise(
    engine: str,
    transport: str,
    cfg: WorkloadConfig,
    batch_seconds: list[float],
    latency_seconds: list[float],
    verified: bool,
    config: dict[str, str],
) -> PeerResult:
    """Median batch time gives GB/s (1e9 bytes) and us/page; latency in microseconds."""
    batch = statistics.median(batch_seconds)
    lat_us = np.asarray(latency_seconds) * 1e6
    return PeerResult(
        engine=engine,
        transport=transport,
        gbps=cfg.region_bytes / batch / 1e9,
        us_per_page=batch * 1e6 / cfg.pages,
        latency_us_p50=float(np.percentile(lat_us, 50)),
        latency_us_p99=float(np.percentile(lat_us, 99)),
        verified=verified,
        pages=cfg.pages,
        page_bytes=cfg.page_bytes,
        batch_gbps_all=[cfg.region_bytes / s / 1e9 for s in batch_seconds],
        config=config,
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    defaults = WorkloadConfig()
    parser.add_argument("--pages", type=int, default=defaults.pages)
    parser.add_argument("--page-size", type=int, default=defaults.page_bytes)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--iters", type=int, default=defaults.iters)
    parser.add_argument("--latency-iters", type=int, default=defaults.latency_iters)


def config_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        pages=args.pages,
        page_bytes=args.page_size,
        seed=args.seed,
        warmup=args.warmup,
        iters=args.iters,
        latency_iters=args.latency_iters,
    )


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call, perf_counter based."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fail(engine: str, transport: str, stage: str, exc: BaseException) -> int:
    """Report a peer that could not run: one JSON object with `error`, exit status 2."""
    emit(
        json.dumps(
            {
                "engine": engine,
                "transport": transport,
                "error": f"{stage}: {type(exc).__name__}: {exc}",
                "verified": False,
            }
        )
    )
    return 2


def claim_stdout() -> None:
    """Point fd 1 at stderr for the rest of the process (and its children), keeping the real
    stdout for `emit`: the peer libraries log to stdout, and the harness promises ONE JSON line."""
    global _RESULT_OUT
    if _RESULT_OUT is None:
        sys.stdout.flush()
        _RESULT_OUT = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)


def emit(line: str) -> None:
    out = _RESULT_OUT if _RESULT_OUT is not None else sys.stdout
    print(line, file=out, flush=True)


_RESULT_OUT = None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
