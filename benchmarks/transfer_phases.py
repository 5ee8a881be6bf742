"""Where one batch's time goes, phase by phase, on tcp and shm (S5, S4c).

    python benchmarks/transfer_phases.py [--provider tcp|shm|all] [--reps N] [--workers idle due]
        [--json PATH]

A sender process (this one) and a spawned receiver, both `TransferEngine(phases=PhaseLog())`,
so the C loop stamps every op and every batch of immediates and the progress threads stamp
the hand-back to Python (`transfer_core.phases`). Each rep posts one batch through the
callback path the messengers use (`post_paged_writes(..., on_done)`); the receiver's counter
fires after the last page and posts the acknowledging immediate, whose arrival ends the rep.
Batches: 64 x 64 KiB (a layer's writes for a few requests), 2,048 x 64 KiB (the peers'
workload) and one 4 KiB write. Both processes stamp CLOCK_MONOTONIC, so their phases line up.
Each batch runs with the workers as a rep leaves them (`idle`: between reps both sides wait on
a pipe, so a batch meets workers that nap, as a request's first layer meets an idle decoder;
on shm, which has no completion fd to sleep on, a nap of up to 1 ms then shows in `arrive`,
`complete` and `ack`) and with what each side waits for marked due at once (`due`:
`expect_soon(..., at_once=True)` on the receiver's counter and the sender's ack, as
`transfer_core/bench.py` runs its back-to-back batches and the decoder marks a request's last
layer). Prints the median of each phase in microseconds; --json writes the rows.
"""

from __future__ import annotations

import argparse
import itertools
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
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transfer_core.engine import TransferEngine  # noqa: E402
from transfer_core.memory import MemoryRegionDescriptor  # noqa: E402
from transfer_core.phases import PhaseLog  # noqa: E402
from transfer_core.transport import PagedWrite  # noqa: E402

# (name, pages, bytes per page)
BATCHES = (("64 x 64 KiB", 64, 65536), ("2048 x 64 KiB", 2048, 65536), ("1 x 4 KiB", 1, 4096))
REGION_PAGES, REGION_PAGE_BYTES = 2048, 65536

# Phase name, what it spans (the table's legend).
PHASES = (
    ("submit", "Python post call until the op is in the C inbox"),
    ("queue", "C inbox until the progress loop hands the first write to the provider"),
    ("post", "first write posted until the last"),
    ("complete", "last write posted until the sender's loop reports the op"),
    ("callback", "reported in C until on_done starts (hand-back to Python)"),
    ("arrive", "sender's first post until the receiver reaps the first immediate"),
    ("stream", "receiver reaps the first immediate until the last"),
    ("count", "last immediate reaped until the counter fired (hand-back, counting)"),
    ("ack", "counter fired, the receiver posts the ack, until the sender reaps it"),
    ("ack_count", "sender reaps the ack until its counter fired"),
    ("total", "Python post call until the ack's counter fired"),
)


WORKERS = ("idle", "due")  # how a rep finds both sides' workers (the module's doc)


def _receiver_main(provider: str, conn: Any) -> None:
    """The target: a region of REGION_PAGES pages; on ("arm", imm, n, due) it expects n
    arrivals (marked due at once if `due`), then acknowledges; on ("record", imm, n) it sends
    its stamps for that rep."""
    log = PhaseLog()
    with TransferEngine(provider, phases=log) as engine:
        region = np.zeros((REGION_PAGES, REGION_PAGE_BYTES), dtype=np.uint8)
        _, desc = engine.register_memory(region, name="phases-dst")
        conn.send(desc.to_bytes())
        ack = MemoryRegionDescriptor.from_bytes(conn.recv())
        fired: dict[int, int] = {}

        def fire(imm: int) -> None:
            fired[imm] = time.monotonic_ns()
            engine.post_imm(imm, ack)

        while (msg := conn.recv())[0] != "stop":
            if msg[0] == "arm":
                engine.expect_imm_count(msg[1], msg[2], lambda imm=msg[1]: fire(imm))
                if msg[3]:
                    engine.expect_soon(msg[1], at_once=True)
                conn.send("armed")
            else:
                records = log.wait_arrivals(msg[1], msg[2])
                conn.send({"first_ns": min(r.arrival.first_ns for r in records),
                           "last_ns": max(r.arrival.last_ns for r in records),
                           "counted_ns": max(r.counted_ns for r in records),
                           "fired_ns": fired[msg[1]]})


class Sender:
    """This side's engine, source pages and ack region."""

    def __init__(self, provider: str) -> None:
        self.log = PhaseLog()
        self.engine = TransferEngine(provider, phases=self.log)
        rng = np.random.default_rng(0)
        self.src = rng.integers(0, 256, size=(REGION_PAGES, REGION_PAGE_BYTES), dtype=np.uint8)
        self.src_mr, _ = self.engine.register_memory(self.src, name="phases-src",
                                                     remote_write=False)
        self.ack = np.zeros(8, dtype=np.uint8)
        _, self.ack_desc = self.engine.register_memory(self.ack, name="phases-ack")

    def rep(self, dst: MemoryRegionDescriptor, imm: int, pages: int, nbytes: int,
            due: bool = False) -> dict[str, int]:
        """One batch, ack included (marked due at once if `due`); the sender's stamps."""
        self.log.clear()
        acked, done, errors = threading.Event(), threading.Event(), []
        stamps: dict[str, int] = {}

        def on_ack() -> None:
            stamps["acked_ns"] = time.monotonic_ns()
            acked.set()

        self.engine.expect_imm_count(imm, 1, on_ack)
        if due:
            self.engine.expect_soon(imm, at_once=True)
        ids = np.arange(pages)
        write = PagedWrite(self.src_mr, ids, REGION_PAGE_BYTES, 0, dst, ids[::-1].copy(),
                           REGION_PAGE_BYTES, 0, nbytes, imm)
        stamps["call_ns"] = time.monotonic_ns()
        self.engine.post_paged_writes(write, done.set, errors.append)
        if not (acked.wait(30) and done.wait(30)) or errors:
            raise RuntimeError(f"rep imm={imm} did not finish: {errors}")
        (op,) = self.log.wait_ops(1)  # recorded just after the callbacks that got us here
        (ack,) = self.log.wait_arrivals(imm, 1)
        return {**stamps, "submit_ns": op.times.submit_ns, "first_post_ns": op.times.first_post_ns,
                "last_post_ns": op.times.last_post_ns, "done_ns": op.times.done_ns,
                "callback_ns": op.callback_ns, "ack_reaped_ns": ack.arrival.last_ns}


def phases_of(s: dict[str, int], r: dict[str, int]) -> dict[str, float]:
    """The phases of one rep in microseconds, from the sender's (s) and receiver's (r) stamps."""
    spans = {
        "submit": (s["call_ns"], s["submit_ns"]), "queue": (s["submit_ns"], s["first_post_ns"]),
        "post": (s["first_post_ns"], s["last_post_ns"]),
        "complete": (s["last_post_ns"], s["done_ns"]), "callback": (s["done_ns"], s["callback_ns"]),
        "arrive": (s["first_post_ns"], r["first_ns"]), "stream": (r["first_ns"], r["last_ns"]),
        "count": (r["last_ns"], r["fired_ns"]), "ack": (r["fired_ns"], s["ack_reaped_ns"]),
        "ack_count": (s["ack_reaped_ns"], s["acked_ns"]), "total": (s["call_ns"], s["acked_ns"]),
    }
    return {name: (end - start) / 1e3 for name, (start, end) in spans.items()}


def run_rep(receiver: Any, sender: Sender, dst: MemoryRegionDescriptor, imm: int, pages: int,
            nbytes: int, due: bool) -> dict[str, float]:
    """One rep's phases: the receiver (at the other end of the `receiver` pipe) armed for
    `pages` writes, the batch and its ack, then both sides' stamps."""
    receiver.send(("arm", imm, pages, due))
    receiver.recv()
    stamps = sender.rep(dst, imm, pages, nbytes, due)
    receiver.send(("record", imm, pages))
    return phases_of(stamps, receiver.recv())


def run_provider(provider: str, reps: int, warmup: int = 3,
                 workers: tuple[str, ...] = WORKERS) -> list[dict[str, Any]]:
    """Every batch on `provider` in each of `workers`' modes: one row each, the median of
    every phase over `reps`."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(provider, child), daemon=True)
    proc.start()
    sender = None
    rows = []
    try:
        dst = MemoryRegionDescriptor.from_bytes(parent.recv())
        sender = Sender(provider)
        parent.send(sender.ack_desc.to_bytes())
        imm = 0
        for mode, (name, pages, nbytes) in itertools.product(workers, BATCHES):
            samples = []
            for rep in range(warmup + reps):
                imm += 1
                phases = run_rep(parent, sender, dst, imm, pages, nbytes, mode == "due")
                if rep >= warmup:
                    samples.append(phases)
            median = {k: round(statistics.median(x[k] for x in samples), 1) for k, _ in PHASES}
            gbps = pages * nbytes / (median["total"] * 1e3)
            rows.append({"provider": sender.engine.provider, "workers": mode, "batch": name,
                         "pages": pages, "page_bytes": nbytes, "reps": reps,
                         "gbps": round(gbps, 2), **median})
        parent.send(("stop",))
        proc.join(30)
    finally:
        if sender is not None:
            sender.engine.close()
        if proc.is_alive():
            proc.kill()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    table = Table(title="Per-phase medians, microseconds (one batch through the callback path)")
    for column in ("provider", "workers", "batch", *(k for k, _ in PHASES), "GB/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["provider"], row["workers"], row["batch"],
                      *(f"{row[k]:.1f}" for k, _ in PHASES), f"{row['gbps']:.2f}")
    console = Console()
    console.print(table)
    for name, meaning in PHASES:
        console.print(f"  {name}: {meaning}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="all", choices=("tcp", "shm", "all"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--workers", nargs="+", default=list(WORKERS), choices=WORKERS,
                        help="how each rep finds the workers (see the module's doc)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    providers = ("tcp", "shm") if args.provider == "all" else (args.provider,)
    rows = [row for p in providers
            for row in run_provider(p, args.reps, workers=tuple(args.workers))]
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
