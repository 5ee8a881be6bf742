"""Prefix caching across the split, measured through the OpenAI HTTP API: one seeded multi-turn
stream against `disagg serve cluster` (1 prefiller + 1 decoder) with the cache and with
`--no-prefix-caching`, side by side in one run (X2).

The stream: `--conversations` chats sharing one system prompt (`--system-len` tokens). Each
turn's prompt is the chat so far (the last prompt plus its answer) plus `--user-len` new
tokens; `--max-tokens` greedy tokens per answer. Turns go one at a time, round-robin over the
chats (turn 1 of every chat, then turn 2, ...), so the cache must hold several chats at once.
Per request: TTFT (first streamed token, from the send), `usage.prompt_tokens_details.
cached_tokens`, and the KV bytes the decoder received for it (the delta of the decoders'
`disagg:kv_bytes_total`, scraped through the front door's `/metrics/targets`; requests never
overlap, so the delta is the request's). The two nodes are pinned one per core, as in
benchmarks/serving.py.
Run: `python benchmarks/prefix.py [--model tiny] [--out prefix.json]` (defaults: ~2 min).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
from disagg_report import percentile  # noqa: E402
from pinned_cluster import wait_for_quiet  # noqa: E402
from result_output import emit  # noqa: E402
from serving import Server, two_cores  # noqa: E402

from disagg.server.scrape_targets import scrape_cluster  # noqa: E402

MODES = {"cache": ["--prefillers", "1", "--decoders", "1"],
         "no cache": ["--prefillers", "1", "--decoders", "1", "--no-prefix-caching"]}


def kv_bytes(server: Server) -> float:
    """KV bytes the decoders have received, scraped from each node the front door lists."""
    return sum(s.value for s in scrape_cluster(server.url, timeout_s=30)
               if s.name == "disagg:kv_bytes_total")


def one_turn(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Stream one request; its answer, TTFT and cached tokens."""
    sent = time.perf_counter()
    ttft, answer, cached = None, [], None
    stream = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids") or []
            if ids and ttft is None:
                ttft = (time.perf_counter() - sent) * 1e3
            answer += ids
    return {"answer": answer, "ttft_ms": ttft, "cached_tokens": cached}


def run_mode(args: argparse.Namespace, mode: str, vocab_size: int) -> list[dict[str, Any]]:
    """Start the server, replay every chat's turns round-robin, stop it; one row a request."""
    rng = random.Random(args.seed)  # the same stream for every mode

    def tokens(n: int) -> list[int]:
        return [rng.randrange(min(16, vocab_size - 1), vocab_size) for _ in range(n)]

    system = tokens(args.system_len)
    chats = [system + tokens(args.user_len) for _ in range(args.conversations)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="prefix-") as scratch:
        server = Server(args, MODES[mode], Path(scratch) / "server.log")
        try:
            wait_for_quiet([pid for _, pid in server.nodes], args.quiet_wait_s)
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                   max_retries=0, timeout=args.timeout_s)
            one_turn(client, tokens(8), 2)  # warm-up: not counted, shares nothing
            for turn in range(args.turns):
                for chat, prompt in enumerate(chats):
                    before = kv_bytes(server)
                    row = one_turn(client, prompt, args.max_tokens)
                    row |= {"chat": chat, "turn": turn + 1, "prompt_tokens": len(prompt),
                            "kv_bytes": kv_bytes(server) - before}
                    rows.append(row)
                    chats[chat] = prompt + row.pop("answer") + tokens(args.user_len)
        finally:
            code = server.stop()
        if code:
            sys.exit(f"{mode}: the server did not stop cleanly:\n"
                     f"{server.log.read_text()[-2000:]}")
    return rows


def summarize(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode and turn: TTFT p50, KV bytes p50, cached tokens; and the ratios side by side."""
    out: dict[str, Any] = {"model": args.model, "workload": {
        k: v for k, v in vars(args).items() if k not in ("out", "json")}, "modes": {}}
    for mode, rows in runs.items():
        turns = {}
        for turn in range(1, args.turns + 1):
            mine = [r for r in rows if r["turn"] == turn]
            turns[turn] = {"prompt_tokens_p50": percentile([r["prompt_tokens"] for r in mine], 50),
                           "ttft_ms_p50": percentile([r["ttft_ms"] for r in mine], 50),
                           "kv_bytes_p50": percentile([r["kv_bytes"] for r in mine], 50),
                           "cached_tokens_p50": percentile([r["cached_tokens"] for r in mine],
                                                           50)}
        out["modes"][mode] = {"turns": turns, "requests": rows,
                              "ttft_ms_p50": percentile([r["ttft_ms"] for r in rows], 50),
                              "kv_bytes_total": sum(r["kv_bytes"] for r in rows)}
    if set(runs) == set(MODES):
        cache, cold = out["modes"]["cache"], out["modes"]["no cache"]
        out["ratios"] = {"ttft_p50_cache_over_no_cache": cache["ttft_ms_p50"] / cold["ttft_ms_p50"],
                         "kv_bytes_cache_over_no_cache": cache["kv_bytes_total"]
                         / cold["kv_bytes_total"]}
    return out


def print_table(result: dict[str, Any]) -> None:
    """A row per turn: prompt length, TTFT and KV MB with and without the cache."""
    from rich.console import Console
    from rich.table import Table

    modes = result["modes"]
    w = result["workload"]
    table = Table(title=f"{result['model']} over HTTP, 1 prefiller + 1 decoder: "
                        f"{w['conversations']} chats x {w['turns']} turns, system prompt "
                        f"{w['system_len']}, +{w['user_len']} per turn, {w['max_tokens']} out")
    table.add_column("turn")
    table.add_column("prompt tokens", justify="right")
    for mode in modes:
        table.add_column(f"TTFT ms ({mode})", justify="right")
    for mode in modes:
        table.add_column(f"KV MB ({mode})", justify="right")
    table.add_column("cached tokens", justify="right")
    first = next(iter(modes.values()))
    for turn, stats in first["turns"].items():
        cells = [str(turn), f"{stats['prompt_tokens_p50']}"]
        cells += [f"{m['turns'][turn]['ttft_ms_p50']:.0f}" for m in modes.values()]
        cells += [f"{m['turns'][turn]['kv_bytes_p50'] / 2**20:.2f}" for m in modes.values()]
        cells.append(str(modes.get("cache", first)["turns"][turn]["cached_tokens_p50"]))
        table.add_row(*cells)
    console = Console(width=max(Console().width, 110))
    console.print(table)
    if "ratios" in result:
        r = result["ratios"]
        console.print(f"with the cache / without: TTFT p50 {r['ttft_p50_cache_over_no_cache']:.2f}x,"
                      f" KV bytes {r['kv_bytes_cache_over_no_cache']:.2f}x (one run, p50 over "
                      "the chats of each turn)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="smollm2-135m, tiny, small or a checkpoint dir")
    add("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    add("--conversations", type=int, default=4)
    add("--turns", type=int, default=4)
    add("--system-len", type=int, default=256, help="the shared system prompt, in tokens")
    add("--user-len", type=int, default=64, help="new tokens a turn adds")
    add("--max-tokens", type=int, default=32, help="tokens of each answer")
    add("--seed", type=int, default=0)
    add("--page-size", type=int, default=16)
    add("--num-pages", type=int, default=512, help="KV pages per node")
    add("--chunk-size", type=int, default=256)
    add("--cores", default="0,1", help="the two cores the two nodes are pinned to")
    add("--quiet-wait-s", type=float, default=20.0)
    add("--timeout-s", type=float, default=300.0)
    add("--malloc-defaults", action="store_true")
    add("--out", type=Path, help="write the JSON result here")
    add("--json", action="store_true", help="print the JSON instead of the table")
    args = parser.parse_args(argv)
    args.cores = two_cores(parser, args.cores)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from disagg.model.loading.registry import load_model

    vocab_size = load_model(args.model).config.vocab_size
    longest = args.system_len + args.turns * (args.user_len + args.max_tokens)
    if longest > args.page_size * args.num_pages:
        sys.exit(f"a chat of {longest} tokens does not fit {args.num_pages} pages")
    emit(args, summarize(args, {mode: run_mode(args, mode, vocab_size) for mode in args.modes}),
         print_table)


if __name__ == "__main__":
    main()
