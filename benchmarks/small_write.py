"""Small-write latency of our transfer core: the old callback path against the waited paths (S5).

    python benchmarks/small_write.py [--provider tcp|shm|all] [--iters N] [--rounds R] [--json]

One 4 KiB write carrying an immediate into another process's region, submit to completion, as
`benchmarks/peers/` times NIXL's single write. Three ways of posting it from Python, measured
in interleaved rounds in one run:
- `callback`: `post_write(..., on_done)` and wait on an Event: the domain's progress thread
  reaps the completion and hands it over (the path `benchmarks/transfer.py` times);
- `waited`: `write_and_wait(...)` with the same arguments each time: the caller posts and
  reaps in its own thread, and every call after the first runs the write prepared by the first;
- `waited-new`: `write_and_wait(...)` to a different 4 KiB slot each call, more slots than the
  engine keeps prepared writes for: every call checks and builds its write anew;
- `prepared`: `prepare_write(...)` once, then `run()` per write (as NIXL's prepped transfer).
Prints a table, or with --json one JSON object (per provider and mode: p50/p99 µs); with
`--mode M --json` a flat object for that mode alone (what `transfer_compare.py` reads).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transfer_core.engine import TransferEngine  # noqa: E402
from transfer_core.memory import MemoryRegionDescriptor  # noqa: E402
from transfer_core.waited import REPEATED_WRITES  # noqa: E402

MODES = ("callback", "waited", "waited-new", "prepared")
IMM = 0xFFFF_FFFF
NBYTES = 4096
SLOTS = 2 * REPEATED_WRITES  # waited-new's target slots: twice what the engine keeps


def _receiver(provider: str, conn: Any) -> None:
    """Owns the target region; reports how many immediates it counted when told to stop."""
    with TransferEngine(provider) as engine:
        _, desc = engine.register_memory(np.zeros(SLOTS * NBYTES, np.uint8), name="small-dst")
        conn.send((desc.to_bytes(), engine.address))
        conn.recv()
        time.sleep(0.05)  # the last immediates' batch (linger 0.5 ms) reaches the counter
        conn.send(engine.imm_counted(IMM))


def _writers(engine: TransferEngine, dst: MemoryRegionDescriptor) -> dict[str, Callable[[], None]]:
    src_mr, _ = engine.register_memory(np.ones(NBYTES, np.uint8), remote_write=False)
    done = threading.Event()
    errors: list[BaseException] = []

    def callback() -> None:
        done.clear()
        engine.post_write(src_mr, 0, NBYTES, IMM, dst, 0, done.set, errors.append)
        if not done.wait(10.0) or errors:
            raise RuntimeError(f"callback write failed: {errors}")

    slots = itertools.cycle(range(0, SLOTS * NBYTES, NBYTES))
    prepared = engine.prepare_write(src_mr, 0, NBYTES, IMM, dst, 0)
    return {
        "callback": callback,
        "waited": lambda: engine.write_and_wait(src_mr, 0, NBYTES, IMM, dst, 0),
        "waited-new": lambda: engine.write_and_wait(src_mr, 0, NBYTES, IMM, dst, next(slots)),
        "prepared": prepared.run,
    }


def measure(
    provider: str, iters: int, rounds: int, modes: tuple[str, ...] = MODES, warmup: int = 200
) -> dict[str, Any]:
    """p50/p99 µs per mode over `rounds` interleaved rounds of `iters` writes each."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(provider, child), daemon=True)
    proc.start()
    samples: dict[str, list[float]] = {m: [] for m in modes}
    try:
        desc, address = parent.recv()
        dst = MemoryRegionDescriptor.from_bytes(desc)
        with TransferEngine(provider) as engine:
            engine.connect(address)
            writers = _writers(engine, dst)
            for mode in modes:
                for _ in range(warmup):
                    writers[mode]()
            for _ in range(rounds):
                for mode in modes:  # interleaved: drifts in background load hit all alike
                    write = writers[mode]
                    for _ in range(iters):
                        start = time.perf_counter_ns()
                        write()
                        samples[mode].append((time.perf_counter_ns() - start) / 1e3)
            provider_name = engine.provider
            sent = (warmup + iters * rounds) * len(modes)
        parent.send("stop")
        counted = parent.recv()
        proc.join(10.0)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {
        "provider": provider_name,
        "bytes": NBYTES,
        "iters": iters * rounds,
        "imms_sent": sent,
        "imms_counted": counted,
        "verified": counted == sent,
        "modes": {
            m: {
                "latency_us_p50": float(np.percentile(v, 50)),
                "latency_us_p99": float(np.percentile(v, 99)),
            }
            for m, v in samples.items()
        },
    }


def _table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="4 KiB write with immediate, submit to completion (µs)")
    for col in ("provider", "mode", "p50", "p99", "imms counted"):
        table.add_column(col, justify="right")
    for r in results:
        for mode, m in r["modes"].items():
            counted = f"{r['imms_counted']}/{r['imms_sent']}"
            table.add_row(
                r["provider"], mode, f"{m['latency_us_p50']:.1f}", f"{m['latency_us_p99']:.1f}",
                counted,
            )  # fmt: skip
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="all", help="tcp, shm or all")
    parser.add_argument("--iters", type=int, default=1000, help="writes per mode per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--mode", choices=MODES, help="measure this mode alone")
    args = parser.parse_args()
    providers = ["tcp", "shm"] if args.provider == "all" else [args.provider]
    modes = (args.mode,) if args.mode else MODES
    results = [measure(p, args.iters, args.rounds, modes) for p in providers]
    if args.json and args.mode and len(results) == 1:
        r = results[0]
        print(json.dumps({"engine": f"ours-{args.mode}", "transport": args.provider,
                          "verified": r["verified"], **r["modes"][args.mode]}))  # fmt: skip
    elif args.json:
        print(
            json.dumps(
                results[0] if len(results) == 1 else dict(zip(providers, results, strict=True))
            )
        )
    else:
        Console(width=max(Console().width, 100)).print(_table(results))
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
