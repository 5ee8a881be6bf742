"""The real KV stream: how long a request's KV takes to land after its prefill's last layer, through
the messengers, against the raw transfer rate of the same writes (S3, S3b, S5).

A prefiller and a decoder run as processes (`LocalCluster`, loopback only), each tracing to its
own Perfetto file. Requests go one at a time through a `Router`: after a warm-up, `--reps` of
each prompt length, on each provider and KV layout. Per request, from the two traces (both on
`time.time()`, one host): the prefiller's `layer_writes` spans (their start is when a layer's
writes were posted) and its `layer_writes_posted` instant of the last layer, which closes the
forward's compute; the decoder's `kv_wait` span, which ends when its engine thread saw the KV
counter fire. tail = KV ready on the decoder - the last layer's writes posted on the prefiller
(S3b: only the last layer should be left in flight when compute ends), and the same from the
end of the prefiller's `step` that ran the forward (the last layer's MLP, the final norm and the
sampled row's logits follow the bump), next to the prefiller's own `transfer_tail` span. The
decoder's receipt (the RUNNING event) gives the writes and bytes moved;
`transfer_core.bench.run_transfer_benchmark` then moves as many writes of the same size
between two bare processes, and one layer's share of the bytes at that raw rate is the time
the tail after the forward is compared with (goal: <= one layer + 1 ms; reported, not
asserted).

Run: `python benchmarks/kv_stream.py [--model smollm2-135m|tiny] [--providers tcp,shm]
[--layouts NHD,HND] [--prompts 512,2048] [--reps 3] [--json PATH]` (about 10 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `disagg` is the package here

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from disagg.control.messages import RequestEvent, Submit  # noqa: E402
from disagg.engine.request import RequestState  # noqa: E402
from disagg.kv_transfer.context_slot import context_slot_nbytes  # noqa: E402
from disagg.model.loading.registry import load_model  # noqa: E402
from disagg.node.cluster_config import ClusterConfig  # noqa: E402
from disagg.node.local_cluster import LocalCluster  # noqa: E402
from disagg.node.router import Router  # noqa: E402
from disagg.utils.trace_merge import Event, load_trace  # noqa: E402
from transfer_core.bench import run_transfer_benchmark  # noqa: E402

logger = logging.getLogger("benchmarks.kv_stream")
PAGE_SIZE = 16
CONTEXT_WRITES = 1  # the hidden state + logits slot that follows the pages (S4a)


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's KV, as both nodes traced it (times in ms, bytes as the decoder counted)."""

    request_id: str
    provider: str
    layout: str
    prompt_tokens: int
    writes: int  # page writes, the context slot left out
    write_nbytes: int  # bytes of each page write
    kv_bytes: int  # every byte the decoder received, the context slot included
    tail_ms: float  # decoder KV ready - prefiller's last layer writes posted
    forward_tail_ms: float  # decoder KV ready - end of the prefiller step that ran the forward
    transfer_tail_ms: float  # the prefiller's own span: last layer posted -> writes completed
    stream_ms: float  # decoder KV ready - first layer writes posted

    @property
    def effective_gbps(self) -> float:
        """The request's bytes over the time from its first posted layer to its KV ready."""
        return self.kv_bytes / (self.stream_ms / 1e3) / 1e9


def serve_one(router: Router, request_id: str, prompt: list[int], max_tokens: int,
              timeout_s: float) -> RequestEvent:
    """Send one request and wait for its end; returns its RUNNING event (the KV receipt)."""
    router.route(Submit(request_id, prompt, max_tokens))
    receipt = None
    deadline = time.time() + timeout_s
    while True:
        event = router.events.get(timeout=max(0.1, deadline - time.time()))
        if event.request_id != request_id:
            continue
        if event.state is RequestState.RUNNING and event.kv_writes:
            receipt = event
        if event.state.is_terminal():
            if event.state is not RequestState.FINISHED_LENGTH or receipt is None:
                raise RuntimeError(f"{request_id} ended {event.state}: {event.detail}")
            return receipt


def of_request(events: list[Event], name: str, request_id: str) -> list[Event]:
    """The complete spans called `name` of one request."""
    return [e for e in events if e["ph"] == "X" and e["name"] == name
            and e.get("args", {}).get("request_id") == request_id]


def sample_of(prefill: list[Event], decode: list[Event], receipt: RequestEvent,
              num_layers: int, context_nbytes: int, case: dict[str, Any]) -> Sample:
    """Read one request's milestones from the two traces (µs epoch) and its receipt."""
    request_id = receipt.request_id
    writes = of_request(prefill, "layer_writes", request_id)
    # The post that carried the last layer (with the layers that rode along with it, X9a).
    last_start = max(e["ts"] for e in writes
                     if e["args"]["layer"] + e["args"].get("layers", 1) == num_layers)
    # The instant follows the posts of every request the forward carried: requests here run
    # alone, so the first one at or after this request's last post is its forward's.
    last_posted = min(e["ts"] for e in prefill if e["name"] == "layer_writes_posted"
                      and e["args"]["layer"] == num_layers - 1 and e["ts"] >= last_start)
    # The step that ran the last layer: its end is the forward's (the last layer's MLP, the
    # final norm, the sampled row's logits come after the bump): the end of the compute.
    step = next(e for e in prefill if e["ph"] == "X" and e["name"] == "step"
                and e["ts"] <= last_posted <= e["ts"] + e["dur"])
    wait = of_request(decode, "kv_wait", request_id)[-1]
    ready = wait["ts"] + wait["dur"]
    tail = of_request(prefill, "transfer_tail", request_id)[-1]
    page_writes = receipt.kv_writes - CONTEXT_WRITES
    return Sample(request_id, writes=page_writes,
                  write_nbytes=(receipt.kv_bytes - context_nbytes) // page_writes,
                  kv_bytes=receipt.kv_bytes, tail_ms=(ready - last_posted) / 1e3,
                  forward_tail_ms=(ready - step["ts"] - step["dur"]) / 1e3,
                  transfer_tail_ms=tail["dur"] / 1e3,
                  stream_ms=(ready - min(e["ts"] for e in writes)) / 1e3, **case)


def run_cluster(args: argparse.Namespace, provider: str, layout: str, vocab_size: int,
                num_layers: int, context_nbytes: int) -> list[Sample]:
    """One cluster of `provider` and `layout`: every prompt length, warm-up first."""
    rng = random.Random(args.seed)
    pages = -(-(max(args.prompts) + args.max_tokens) // PAGE_SIZE)
    with tempfile.TemporaryDirectory(prefix=f"kv-stream-{provider}-{layout}-") as scratch:
        config = ClusterConfig.from_options(
            model=args.model, page_size=PAGE_SIZE, num_pages=pages + 8, prefix_caching=False,
            chunk_size=args.chunk_size or max(args.prompts), provider=provider,
            kv_layout=layout, trace=scratch)
        done: list[tuple[RequestEvent, dict[str, Any]]] = []
        with LocalCluster(config) as cluster:
            router = Router(cluster.decoder_addresses)
            try:
                for length in args.prompts:
                    case = {"provider": provider, "layout": layout, "prompt_tokens": length}
                    for rep in range(-1, args.reps):  # rep -1: the warm-up, never read
                        # Below 16 sit the special tokens of most vocabularies.
                        prompt = [rng.randrange(16, vocab_size) for _ in range(length)]
                        request_id = f"{provider}-{layout}-{length}-{rep}"
                        receipt = serve_one(router, request_id, prompt, args.max_tokens,
                                            args.timeout_s)
                        if rep >= 0:
                            done.append((receipt, case))
            finally:
                router.close()
        # The nodes write their traces at exit: read after the cluster stopped.
        prefill = load_trace(Path(scratch) / "prefill-0.json")
        decode = load_trace(Path(scratch) / "decode-0.json")
    return [sample_of(prefill, decode, receipt, num_layers, context_nbytes, case)
            for receipt, case in done]


def raw_gbps(provider: str, writes: int, write_nbytes: int) -> float:
    """The bare transfer core's rate for as many writes of that size, two processes."""
    result = run_transfer_benchmark(provider, num_pages=writes, page_bytes=write_nbytes,
                                    reps=3, latency_iters=10, wait_idle=False)
    return float(result["gbps"])


def summarize(samples: list[Sample], num_layers: int) -> list[dict[str, Any]]:
    """One row per provider, layout and prompt length: medians, and the raw comparison."""
    groups: dict[tuple[str, str, int], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.provider, s.layout, s.prompt_tokens), []).append(s)
    raw: dict[tuple[str, int, int], float] = {}
    rows = []
    for (provider, layout, length), group in groups.items():
        first = group[0]
        key = (provider, first.writes, first.write_nbytes)
        if key not in raw:  # the layout changes nothing the bare transfer sees
            raw[key] = raw_gbps(*key)
        layer_ms = first.writes * first.write_nbytes / num_layers / (raw[key] * 1e9) * 1e3
        tail = statistics.median(s.tail_ms for s in group)
        forward_tail = statistics.median(s.forward_tail_ms for s in group)
        rows.append({
            "provider": provider, "layout": layout, "prompt_tokens": length,
            "kv_mb": first.kv_bytes / 1e6, "writes": first.writes,
            "write_nbytes": first.write_nbytes, "reps": len(group), "tail_ms_p50": tail,
            "forward_tail_ms_p50": forward_tail,
            "transfer_tail_ms_p50": statistics.median(s.transfer_tail_ms for s in group),
            "effective_gbps": statistics.median(s.effective_gbps for s in group),
            "raw_gbps": raw[key], "layer_at_raw_ms": layer_ms,
            "goal_met": forward_tail <= layer_ms + 1.0})
    return rows


def print_table(rows: list[dict[str, Any]], model: str, num_layers: int) -> None:
    """The rich table of the rows."""
    table = Table(title=f"KV stream, prefiller -> decoder ({model}, {num_layers} layers, "
                        f"page {PAGE_SIZE})")
    for column in ("provider", "layout", "prompt tokens", "KV MB", "tail ms p50",
                   "after forward ms p50", "prefiller transfer_tail ms p50", "effective GB/s",
                   "raw GB/s", "one layer at raw rate ms", "goal met"):
        table.add_column(column, justify="left" if column in ("provider", "layout") else "right")
    for r in rows:
        table.add_row(r["provider"], r["layout"], str(r["prompt_tokens"]), f"{r['kv_mb']:.2f}",
                      f"{r['tail_ms_p50']:.2f}", f"{r['forward_tail_ms_p50']:.2f}",
                      f"{r['transfer_tail_ms_p50']:.2f}",
                      f"{r['effective_gbps']:.2f}", f"{r['raw_gbps']:.2f}",
                      f"{r['layer_at_raw_ms']:.2f}", "yes" if r["goal_met"] else "no")
    Console().print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: the full SmolLM2 run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m, tiny, small or a checkpoint dir")
    add("--providers", default="tcp,shm", help="comma-separated fabric providers")
    add("--layouts", default="NHD,HND", help="comma-separated KV layouts")
    add("--prompts", default="512,2048", help="comma-separated prompt lengths (tokens)")
    add("--reps", type=int, default=3, help="measured requests per prompt length")
    add("--max-tokens", type=int, default=1)
    add("--chunk-size", type=int, default=0,
        help="prefill chunk; 0: the longest prompt, so each request is one forward")
    add("--seed", type=int, default=0)
    add("--timeout-s", type=float, default=300.0, help="longest one request may take")
    add("--json", dest="json_path", help="also write the rows and samples here")
    args = parser.parse_args(argv)
    args.providers = [p for p in args.providers.split(",") if p]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.prompts = [int(n) for n in args.prompts.split(",") if n]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every provider and layout; print the table; returns what `--json` writes."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    model = load_model(args.model).config
    samples = [s for provider in args.providers for layout in args.layouts
               for s in run_cluster(args, provider, layout, model.vocab_size, model.num_layers,
                                    context_slot_nbytes(model))]
    rows = summarize(samples, model.num_layers)
    print_table(rows, args.model, model.num_layers)
    result = {"model": args.model, "num_layers": model.num_layers, "page_size": PAGE_SIZE,
              "max_tokens": args.max_tokens, "rows": rows,
              "samples": [asdict(s) for s in samples]}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
