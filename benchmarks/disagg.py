"""Mixed versus disaggregated serving on this machine: one request stream, served two ways (S1).

A seeded stream: a few short prompts with long outputs start first, then long prompts arrive at
a fixed interval while those decode. (a) "mixed": two single-node engines (`serve mixed`), one
per core, the router splitting requests; each step batches prefill chunks with decodes, so a
long prompt stalls every decode on its node. (b) "disagg": a prefiller and a decoder, one core
each; the decoder's steps hold only decodes. Latencies come from the router's RequestEvent
arrival times; the TTFT split (queue, prefill, transfer tail) from the prefiller's trace.
Run: `python benchmarks/disagg.py [--model smollm2-135m|tiny|small] [--json]` (about 3 min).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import queue
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This file shares its name with the package it measures: the repository root goes first on the
# path so that `import disagg` finds the package. And when a sibling script in benchmarks/
# imports `disagg` and finds this file instead, it steps aside for the real package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __name__ == "disagg":
    del sys.modules["disagg"]
    sys.modules["disagg"] = importlib.import_module("disagg")

from disagg_report import print_tables, summarize  # noqa: E402
from pinned_cluster import (  # noqa: E402
    CpuMeter,
    CpuSampler,
    Mode,
    PinnedCluster,
    wait_for_quiet,
)

from disagg.control.messages import Submit  # noqa: E402
from disagg.control.messages import RequestEvent
from disagg.engine.request import FailureCause, RequestState  # noqa: E402
from disagg.model.loading.registry import load_model  # noqa: E402
from disagg.node.cluster_config import ClusterConfig  # noqa: E402
from disagg.node.router import Router  # noqa: E402

logger = logging.getLogger("benchmarks.disagg")

# glibc hands every allocation above its mmap threshold (128 KiB until a large free raises it)
# back to the kernel when freed, so a decoder whose padded attention gathers megabytes per layer
# page-faults and zeroes that memory again on every step: 2-2.5x slower steps once a long
# context joins the batch. A single-node engine mostly escapes it by accident (its prefill
# chunks raise the threshold). Fixing the threshold for every node keeps this allocator effect
# out of the comparison; `--malloc-defaults` measures with it.
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the stream: when it is sent, what it asks for."""

    at_s: float
    request_id: str
    kind: str  # "short" (decodes for long) or "long" (a long prompt)
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Observed:
    """What the router saw of one request (`time.time()` seconds, the traces' clock)."""

    arrival: Arrival
    submitted_at: float = 0.0
    node: int = -1
    state: RequestState = RequestState.WAITING
    token_times: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Whether the request reached a terminal state."""
        return self.state.is_terminal()


def make_schedule(args: argparse.Namespace, vocab_size: int) -> list[Arrival]:
    """The seeded stream: shorts at t=0 (staggered 50 ms), then one long every interval."""
    rng = random.Random(args.seed)

    def prompt(length: int) -> list[int]:
        # Skip the lowest ids: special tokens (BOS, EOS) live there in most vocabularies.
        return [rng.randrange(min(16, vocab_size - 1), vocab_size) for _ in range(length)]

    stream = [Arrival(0.05 * i, f"short-{i}", "short", prompt(args.short_prompt_len),
                      args.short_max_tokens) for i in range(args.num_short)]
    stream += [Arrival(args.first_long_s + i * args.interval_s, f"long-{i}", "long",
                       prompt(args.long_prompt_len), args.long_max_tokens)
               for i in range(args.num_long)]
    return stream


def cluster_config(args: argparse.Namespace, schedule: list[Arrival], trace_dir: str
                   ) -> ClusterConfig:
    """Options shared by every node of both modes: one torch thread, a cache that fits the
    whole stream at once (so no request waits for pages), a trace file per node."""
    pages = sum(-(-(len(a.prompt_token_ids) + a.max_tokens) // args.page_size)
                for a in schedule)
    return ClusterConfig.from_options(model=args.model, num_decoders=1, page_size=args.page_size,
                                      num_pages=pages + 16, chunk_size=args.chunk_size, threads=1,
                                      trace=trace_dir)


def serve_stream(router: Router, schedule: list[Arrival], timeout_s: float
                 ) -> tuple[list[Observed], float, float]:
    """Send each request at its time, collect events until all end; returns the requests,
    the start time and the end time."""
    observed = [Observed(arrival) for arrival in schedule]
    by_id = {o.arrival.request_id: o for o in observed}
    pending = sorted(observed, key=lambda o: o.arrival.at_s)
    start = time.time()
    deadline = start + timeout_s
    while not all(o.done for o in observed):
        now = time.time()
        if now > deadline:
            raise TimeoutError(f"stream not done after {timeout_s:.0f} s: "
                               f"{sum(not o.done for o in observed)} requests open")
        while pending and start + pending[0].arrival.at_s <= now:
            request = pending.pop(0)
            a = request.arrival
            request.submitted_at = time.time()
            request.node = router.route(Submit(a.request_id, a.prompt_token_ids,
                                                a.max_tokens))
        wait = start + pending[0].arrival.at_s - time.time() if pending else 1.0
        try:
            event = router.events.get(timeout=max(0.0, min(wait, 1.0)))
        except queue.Empty:
            continue
        received = time.time()
        apply_event(by_id, event, received)
    return observed, start, time.time()


def apply_event(by_id: dict[str, Observed], event: RequestEvent, received: float) -> None:
    """Fold one decoder event into its request; a dead node ends the run."""
    if event.cause is FailureCause.DECODER_DIED:
        raise RuntimeError(f"a serving node died: {event.detail}")
    request = by_id[event.request_id]
    request.state = event.state
    request.token_times.extend(received for _ in event.token_ids)
    if event.state is RequestState.FINISHED_FAILED:
        logger.warning("%s failed: %s", event.request_id, event.detail)


def run_mode(args: argparse.Namespace, mode: Mode, schedule: list[Arrival]) -> dict[str, Any]:
    """Start the nodes, wait for a quiet machine, serve the stream, stop; returns the raw
    observations, the node traces and the CPU accounting."""
    with tempfile.TemporaryDirectory(prefix=f"disagg-bench-{mode}-") as scratch:
        trace_dir = scratch if args.trace_dir is None else os.path.join(args.trace_dir, mode)
        os.makedirs(trace_dir, exist_ok=True)
        config = cluster_config(args, schedule, trace_dir)
        with PinnedCluster(config, mode, cores=args.cores) as cluster:
            ours = [process.pid for process in cluster.processes] + [os.getpid()]
            quiet = wait_for_quiet(ours, args.quiet_wait_s)
            router = Router(cluster.decoder_addresses)
            meter, sampler = CpuMeter(ours), CpuSampler(ours)
            observed, start, end = serve_stream(router, schedule, args.timeout_s)
            cpu, others = meter.read(), sampler.stop()
            affinity = cluster.affinity()
            router.close()
        traces = {path.stem: json.loads(path.read_text())["traceEvents"]
                  for path in Path(trace_dir).glob("*.json")}
    return {"mode": mode, "observed": observed, "start": start, "end": end, "traces": traces,
            "cpu": cpu, "others_cpu": others, "affinity": affinity, "quiet": quiet}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: the ~3 minute SmolLM2 run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m, tiny, small or a checkpoint dir")
    add("--modes", default="mixed,disagg", help="comma-separated: mixed, disagg")
    add("--num-short", type=int, default=4, help="short prompts started first")
    add("--short-prompt-len", type=int, default=16)
    add("--short-max-tokens", type=int, default=320)
    add("--num-long", type=int, default=14, help="long prompts arriving while shorts decode")
    add("--long-prompt-len", type=int, default=512)
    add("--long-max-tokens", type=int, default=32)
    add("--first-long-s", type=float, default=2.0, help="when the first long prompt arrives")
    add("--interval-s", type=float, default=2.5, help="seconds between long prompts")
    add("--chunk-size", type=int, default=256, help="prefill chunk (and step token budget)")
    add("--page-size", type=int, default=16)
    add("--cores", default="0,1", help="the two cores the nodes are pinned to")
    add("--seed", type=int, default=0)
    add("--quiet-wait-s", type=float, default=20.0, help="longest wait for an idle machine")
    add("--timeout-s", type=float, default=300.0, help="longest a stream may take")
    add("--malloc-defaults", action="store_true",
        help="leave glibc's malloc thresholds alone in the nodes (see MALLOC_TUNING)")
    add("--trace-dir", help="keep each node's Chrome trace here (<dir>/<mode>/<node>.json)")
    add("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)
    args.cores = [int(c) for c in args.cores.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    if not set(args.modes) <= {"mixed", "disagg"} or not args.modes:
        parser.error(f"--modes: expected mixed and/or disagg, got {args.modes}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run every mode on the same stream; print the tables or the JSON."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    if not args.malloc_defaults:
        os.environ.update(MALLOC_TUNING)  # the nodes inherit this process's environment
    schedule = make_schedule(args, load_model(args.model).config.vocab_size)
    runs = {mode: run_mode(args, mode, schedule) for mode in args.modes}
    result = summarize(args, runs)
    result["node_env"] = {} if args.malloc_defaults else MALLOC_TUNING
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        print_tables(result)


if __name__ == "__main__":
    main()
