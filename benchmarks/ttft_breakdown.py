"""Where the time to first token goes, mixed against disaggregated, one request at a time
(S1, S2, S3, S4a): every millisecond between the two TTFTs, from the processes' own traces.

Both ways run `disagg serve cluster` with `--trace` (`serving.Server`: nodes pinned one per
core, the front door and this client unpinned): (a) "disagg", a prefiller and a decoder; (b)
"mixed", two mixed nodes. Prompts of `--lengths` random tokens (no prefix shared, so no cache
hit), `--reps` each after a warm-up, `max_tokens` 2, streamed with the `openai` client, one at
a time. Each process traces on `time.time()`, so the spans of one request (its id is the
response id without `cmpl-`) line up across them:
- front door: its POST span's start until its `route` span (parse, checks, tokens);
- router -> node: `route` until the node's `request` span opens;
- disagg only: admission (until the decoder's `admission` span ends: it asks a prefiller),
  the hop to the prefiller (until its `queue` span), its queue, its `prefill` (until the last
  layer's writes are posted), the tail (until the decoder's `kv_wait` ends: the forward's end,
  both sides' checksum, the context write) and the first step (until `first_token_sent`);
- mixed only: the node's prefill and first token (`request` start to `first_token_sent`);
- back: `first_token_sent` until the front door's `first_token`; client: the rest of the TTFT
  the client measured (HTTP, the stream's first chunk, this process).
Each part starts where the one before it ends, so a request's parts add up to its TTFT.
Prints p50 per part and mode, and the difference disagg - mixed part by part; then each node
thread's CPU time and time waiting for a CPU per measured request, by length (`thread_times`:
the scheduler's own accounting, so a forward slowed by its node's other threads shows there). Run:
`python benchmarks/ttft_breakdown.py [--model smollm2-135m] [--lengths 6 400] [--reps 3]
[--min-post-kib K] [--provider P] [--untraced] [--json PATH]` (about 2 min). `--untraced` runs
without `--trace` and reports the client's TTFT and the threads' times only: the parts need
the traces, and tracing costs the disaggregated side more than the mixed one (its per-layer
spans).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from rich.console import Console
from rich.table import Table
from serving import MODE_FLAGS, Server, two_cores
from step_times import read_events
from thread_times import per_unit, snapshot

PARTS = ("front_door", "to_node", "admission", "to_prefiller", "prefill_queue", "prefill",
         "tail", "first_step", "node_prefill", "back", "client")
TRACED = ("ttft_ms", *PARTS)  # what a traced run reports; an untraced one, the TTFT alone


def spans_by_request(events: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """request id -> span or instant name -> its event (the last one, if several)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for event in events:
        request_id = event.get("args", {}).get("request_id")
        if request_id is not None and event.get("ph") in ("X", "i", "I"):
            out.setdefault(request_id, {})[event["name"]] = event
    return out


def end(event: dict[str, Any]) -> float:
    return event["ts"] + event.get("dur", 0)


def breakdown(spans: dict[str, dict[str, Any]], post: dict[str, Any], ttft_ms: float
              ) -> dict[str, float]:
    """The parts of one request's TTFT in ms (those its mode has), from its spans, the front
    door's POST span that carried it and the client's TTFT."""
    route, request = spans["route"], spans["request"]
    sent, first = spans["first_token_sent"]["ts"], spans["first_token"]["ts"]
    parts = {"front_door": route["ts"] - post["ts"], "to_node": request["ts"] - route["ts"]}
    if "kv_wait" in spans:  # a decoder that was sent the KV
        admission, queue = spans["admission"], spans["queue"]
        ready = end(spans["kv_wait"])
        # Each part runs from the previous one's end: together they tile the TTFT.
        parts |= {"admission": end(admission) - request["ts"],
                  "to_prefiller": queue["ts"] - end(admission), "prefill_queue": queue["dur"],
                  "prefill": end(spans["prefill"]) - end(queue),
                  "tail": ready - end(spans["prefill"]), "first_step": sent - ready}
    else:
        parts["node_prefill"] = sent - request["ts"]
    parts["back"] = first - sent
    measured = {name: us / 1e3 for name, us in parts.items()}
    measured["client"] = ttft_ms - (first - post["ts"]) / 1e3
    return measured


def run_mode(args: argparse.Namespace, mode: str, prompts: list[list[int]]
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Serve `prompts` one at a time (the first of each length a warm-up); a row per request
    measured (its length, client TTFT and parts), and per length each node thread's CPU and
    wait for a CPU per measured request (`thread_times`)."""
    with tempfile.TemporaryDirectory(prefix=f"ttft-{mode}-") as scratch:
        flags = MODE_FLAGS[mode]
        if mode == "disagg" and args.min_post_kib is not None:
            flags = [*flags, "--min-post-kib", str(args.min_post_kib)]
        if mode == "disagg" and args.provider is not None:
            flags = [*flags, "--provider", args.provider]
        trace = None if args.untraced else Path(scratch) / "trace"
        server = Server(args, flags, Path(scratch) / "server.log", trace)
        measured: list[tuple[str, int, float]] = []
        threads: list[dict[str, Any]] = []
        block = args.reps + 1  # a warm-up, then the measured requests of one length
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                   max_retries=0, timeout=600)
            for index, prompt in enumerate(prompts):
                if index % block == 1:
                    before = snapshot(server.nodes)
                start, request_id = time.perf_counter(), None
                for chunk in client.completions.create(
                        model="bench", prompt=prompt, max_tokens=2, temperature=0,
                        stream=True):
                    ids = chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids")
                    if ids and request_id is None:
                        ttft, request_id = (time.perf_counter() - start) * 1e3, chunk.id
                if index % block:  # the first of each length warms up
                    measured.append((request_id.removeprefix("cmpl-"), len(prompt), ttft))
                if index % block == block - 1 and block > 1:
                    threads += [{"mode": mode, "tokens": len(prompt), "thread": t.thread,
                                 "cpu_ms": t.cpu_ms, "wait_ms": t.wait_ms}
                                for t in per_unit(before, snapshot(server.nodes), args.reps)]
        finally:
            if server.stop():
                raise RuntimeError(f"{mode}: the server did not stop cleanly")
        if trace is None:  # the client's TTFT is all there is
            return [{"mode": mode, "tokens": length, "ttft_ms": ttft}
                    for _, length, ttft in measured], threads
        events, missing = read_events(sorted(trace.glob("*.json")))
        if missing:
            raise RuntimeError(f"{mode}: traces missing: {missing}")
    spans = spans_by_request(events)
    posts = sorted((e for e in events if e.get("name") == "POST /v1/completions"),
                   key=lambda e: e["ts"])
    rows = []
    for request_id, length, ttft in measured:
        mine = spans[request_id]
        post = max((p for p in posts if p["ts"] <= mine["route"]["ts"]), key=lambda p: p["ts"])
        rows.append({"mode": mode, "tokens": length, "ttft_ms": ttft,
                     **breakdown(mine, post, ttft)})
    return rows, threads


def summarize(rows: list[dict[str, Any]], keys: tuple[str, ...] = TRACED) -> list[dict[str, Any]]:
    """p50 of every part in `keys` per (mode, length)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["mode"], row["tokens"]), []).append(row)
    return [{"mode": mode, "tokens": tokens, "reps": len(group),
             **{key: statistics.median(r.get(key, 0.0) for r in group) for key in keys}}
            for (mode, tokens), group in sorted(groups.items())]


def print_table(summary: list[dict[str, Any]], keys: tuple[str, ...] = TRACED) -> None:
    """One row per part in `keys`, a column per mode and length, and disagg - mixed where
    both ran."""
    by = {(s["mode"], s["tokens"]): s for s in summary}
    columns = [(mode, tokens) for tokens in sorted({s["tokens"] for s in summary})
               for mode in ("disagg", "mixed", "diff")
               if mode != "diff" and (mode, tokens) in by
               or mode == "diff" and ("disagg", tokens) in by and ("mixed", tokens) in by]
    table = Table(title="TTFT, p50 ms per part, one request at a time")
    table.add_column("part")
    for mode, tokens in columns:
        table.add_column(f"{mode if mode != 'diff' else 'disagg - mixed'} {tokens}",
                         justify="right")

    def cell(key: str, mode: str, tokens: int) -> str:
        if mode == "diff":
            return f"{by['disagg', tokens][key] - by['mixed', tokens][key]:+.1f}"
        return f"{by[mode, tokens][key]:.1f}"

    for key in keys:
        table.add_row(key, *(cell(key, mode, tokens) for mode, tokens in columns))
    Console().print(table)


def print_threads(threads: list[dict[str, Any]]) -> None:
    """Each node thread's CPU and wait for a CPU, ms per measured request."""
    table = Table(title="node threads, ms per request: on a CPU / waiting for one")
    for column in ("mode", "tokens", "thread", "cpu", "wait"):
        table.add_column(column, justify="left" if column == "thread" else "right")
    for t in threads:
        table.add_row(t["mode"], str(t["tokens"]), t["thread"], f"{t['cpu_ms']:.2f}",
                      f"{t['wait_ms']:.2f}")
    Console().print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m, tiny, small or a checkpoint dir")
    add("--modes", nargs="+", choices=["disagg", "mixed"], default=["disagg", "mixed"])
    add("--lengths", type=int, nargs="+", default=[6, 400], help="prompt lengths (tokens)")
    add("--reps", type=int, default=3, help="measured requests per length")
    add("--page-size", type=int, default=16)
    add("--num-pages", type=int, default=512, help="KV pages per node")
    add("--chunk-size", type=int, default=512, help="prefill chunk (and step token budget)")
    add("--cores", default="0,1", help="the two cores the two nodes are pinned to")
    add("--malloc-defaults", action="store_true", help="leave glibc's malloc thresholds alone")
    add("--seed", type=int, default=0)
    add("--min-post-kib", type=int, help="the prefiller's --min-post-kib (X9a; 0: each layer "
        "posted alone; default: the node's)")
    add("--provider", help="the disaggregated nodes' libfabric provider (default: the node's, "
        "tcp)")
    add("--untraced", action="store_true", help="no tracing: the client's TTFT and the "
        "threads' times only (tracing costs the disaggregated side more: its per-layer spans)")
    add("--json", type=Path, help="write the rows and the summary here")
    args = parser.parse_args(argv)
    args.cores = two_cores(parser, args.cores)
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from disagg.model.loading.registry import load_model

    vocab = load_model(args.model).config.vocab_size
    rng = random.Random(args.seed)
    rows, threads = [], []
    for mode in args.modes:
        # Fresh random tokens per request: no prefix is ever shared (no cache hit).
        prompts = [[rng.randrange(min(16, vocab - 1), vocab) for _ in range(n)]
                   for n in args.lengths for _ in range(args.reps + 1)]
        measured, used = run_mode(args, mode, prompts)
        rows, threads = rows + measured, threads + used
    keys = ("ttft_ms",) if args.untraced else TRACED
    summary = summarize(rows, keys)
    print_table(summary, keys)
    print_threads(threads)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary,
                                         "threads": threads}, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
