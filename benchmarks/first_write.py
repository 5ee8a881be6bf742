"""First write to a new peer, with and without `TransferEngine.connect` first (S5).

    python benchmarks/first_write.py [--provider tcp|shm|all] [--reps N] [--json] [--no-wait-idle]

tcp;ofi_rxm connects lazily, so the first write to a peer also pays for the connection. A
spawned receiver process opens a fresh engine (a new peer) for every sample; the sender, one
engine for the whole run, alternates the two cases in one run:

* cold: submit a 4 KiB write with an immediate at once;
* warm: `connect(peer.address)` first (timed on its own), then the same write.

Per sample: the first write's sender latency (submit to on_done), when it landed (submit to the
receiver's counter firing: CLOCK_MONOTONIC is one clock for both processes), and a second
write's latency as the steady state. Prints a rich table and then one JSON line (medians, min,
max). Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transfer_core.bench import cpu_busy_fraction, wait_for_idle  # noqa: E402
from transfer_core.engine import TransferEngine  # noqa: E402
from transfer_core.memory import MemoryRegionDescriptor  # noqa: E402

PAGE = 4096
IMM = 1
METRICS = ("connect_ms", "first_write_ms", "first_landed_ms", "second_write_ms")


def _receiver(provider: str, conn: Any) -> None:
    """Spawned: on "new", a fresh engine (a new peer) expecting one write; "landed" answers
    when that write was counted; "close" / "stop" close it."""
    engine: TransferEngine | None = None
    landed: list[float] = []
    while True:
        cmd = conn.recv()
        if engine is not None and cmd in ("new", "stop"):
            engine.close()
            engine = None
        if cmd == "stop":
            conn.send(None)
            return
        if cmd == "new":
            engine = TransferEngine(provider)
            _, desc = engine.register_memory(np.zeros(2 * PAGE, np.uint8))
            landed = []
            engine.expect_imm_count(IMM, 1, lambda out=landed: out.append(time.monotonic()))
            conn.send((engine.address, desc.to_bytes()))
        elif cmd == "landed":
            deadline = time.monotonic() + 30
            while not landed and time.monotonic() < deadline:
                time.sleep(0.001)
            conn.send(landed[0] if landed else None)


def _write_ms(engine: TransferEngine, src: Any, desc: MemoryRegionDescriptor, imm: int) -> float:
    """Submit one 4 KiB write and wait for its on_done; milliseconds."""
    done = threading.Event()
    errors: list[BaseException] = []
    start = time.monotonic()
    engine.post_write(src, 0, PAGE, imm, desc, 0, done.set,
                        lambda e: (errors.append(e), done.set()))  # fmt: skip
    if not done.wait(30) or errors:
        raise RuntimeError(f"write failed: {errors or 'no completion in 30 s'}")
    return (time.monotonic() - start) * 1e3


def measure(provider: str, reps: int) -> dict[str, dict[str, list[float]]]:
    """`reps` samples of each case, interleaved cold/warm, against fresh peers."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(provider, child), daemon=True)
    proc.start()
    samples: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    try:
        with TransferEngine(provider) as engine:
            src, _ = engine.register_memory(np.ones(PAGE, np.uint8))
            for rep in range(reps):
                for case in ("cold", "warm") if rep % 2 == 0 else ("warm", "cold"):
                    conn.send("new")
                    address, raw = conn.recv()
                    desc = MemoryRegionDescriptor.from_bytes(raw)
                    row: dict[str, float] = {"connect_ms": 0.0}
                    if case == "warm":
                        start = time.monotonic()
                        engine.connect(address)
                        row["connect_ms"] = (time.monotonic() - start) * 1e3
                    start = time.monotonic()
                    row["first_write_ms"] = _write_ms(engine, src, desc, IMM)
                    conn.send("landed")
                    landed = conn.recv()
                    row["first_landed_ms"] = (landed - start) * 1e3 if landed else float("nan")
                    row["second_write_ms"] = _write_ms(engine, src, desc, IMM + 1)
                    for metric, value in row.items():
                        samples[case].setdefault(metric, []).append(value)
    finally:
        conn.send("stop")
        conn.recv()
        proc.join(30)
    return samples


def summarise(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    return {
        case: {
            m: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
            for m, v in rows.items()
        }
        for case, rows in samples.items()
    }


def _table(results: dict[str, dict[str, Any]]) -> Table:
    table = Table(title=escape("First 4 KiB write to a new peer: median [min-max] ms"))
    for column in ("provider", "case", *METRICS):
        table.add_column(column, justify="right")
    for provider, summary in results.items():
        for case in ("cold", "warm"):
            cells = []
            for m in METRICS:
                s = summary[case][m]
                cells.append(escape(f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"))
            table.add_row(provider, case, *cells)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="all", help="tcp, shm or all")
    parser.add_argument("--reps", type=int, default=10, help="samples of each case")
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    parser.add_argument("--no-wait-idle", action="store_true", help="skip waiting for idle CPUs")
    args = parser.parse_args()
    providers = ["tcp", "shm"] if args.provider == "all" else [args.provider]
    busy = cpu_busy_fraction(0.2) if args.no_wait_idle else wait_for_idle()
    results = {p: summarise(measure(p, args.reps)) for p in providers}
    if not args.json:
        Console(width=max(Console().width, 140)).print(_table(results))
    print(json.dumps({"cpu_busy_before": busy, "page_bytes": PAGE, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
