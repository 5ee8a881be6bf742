"""Load under failure (issue 8): many requests, random aborts, a prefiller and a decoder killed.

Starts prefillers and decoders as processes over the tcp provider, sends N requests at a steady
rate, aborts a fraction at random moments, SIGKILLs one prefiller and one decoder mid-run, and
checks the promises: every request reaches exactly one terminal state before its deadline,
every request that finished decoded the single-node engine's tokens, and every surviving node
shuts down with no page, request, transfer context or counter left (exit code 0 after its own
leak check). Prints a table, or one JSON object with `--json`.
Run: `python benchmarks/load.py [--requests 1000] [--decoders 3] [--prefillers 2]`.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time

import torch

from disagg.config import CacheConfig, EngineConfig, ReliabilityConfig, SchedulerConfig
from disagg.engine.llm_engine import build_engine
from disagg.engine.request import SamplingParams
from disagg.kv_transfer.messages import Submit
from disagg.model.loading.registry import load_model
from disagg.node.local_cluster import ClusterConfig, LocalCluster
from disagg.node.router import Router


def reference_tokens(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    loaded = load_model(model)
    engine = build_engine(EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=4096),
                                       SchedulerConfig(max_num_seqs=256,
                                                       max_num_batched_tokens=2048)),
                          loaded.state_dict)
    return [r.output_token_ids for r in engine.generate(prompts, SamplingParams(max_tokens))]


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    vocab = load_model(args.model).config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (rng.randint(2, args.max_prompt),),
                             generator=generator).tolist() for _ in range(args.requests)]
    expected = reference_tokens(args.model, prompts, args.max_tokens)
    aborted = set(rng.sample(range(args.requests), int(args.abort_fraction * args.requests)))
    config = ClusterConfig(model=args.model, num_decoders=args.decoders,
                           num_prefillers=args.prefillers, page_size=8, chunk_size=64,
                           num_pages=1024,
                           reliability=ReliabilityConfig(kv_timeout_s=args.kv_timeout))
    deadline_s = args.kv_timeout * 3 + 30
    submitted: dict[str, float] = {}
    final: dict[str, tuple[str, float]] = {}
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    duplicates = []
    with LocalCluster(config) as cluster:
        router = Router(cluster.decoder_addresses)
        done = threading.Event()

        def collect() -> None:
            while len(final) < args.requests:
                event = router.events.get()
                tokens[event.request_id] += event.token_ids
                if event.state.is_terminal():
                    if event.request_id in final:
                        duplicates.append(event.request_id)
                    final[event.request_id] = (event.state.value, time.monotonic())
            done.set()

        threading.Thread(target=collect, daemon=True).start()
        kills = {args.requests // 3: "prefill-0", args.requests // 2: "decode-0"}
        started = time.monotonic()
        for i, prompt in enumerate(prompts):
            if i in kills:
                cluster.kill(kills[i])
            request_id = f"r{i}"
            submitted[request_id] = time.monotonic()
            router.submit(Submit(request_id, prompt, args.max_tokens))
            if i in aborted:
                threading.Timer(rng.uniform(0, 0.3), router.abort, args=(request_id,)).start()
            time.sleep(1 / args.rate)
        finished_in_time = done.wait(deadline_s)
        wall_s = time.monotonic() - started
        router.close()
    exit_codes = dict(zip(cluster.names, cluster.exit_codes(), strict=True))
    states = collections.Counter(state for state, _ in final.values())
    wrong = [rid for rid, (state, _) in final.items()
             if state in ("finished_length", "finished_stopped")
             and tokens[rid] != expected[int(rid[1:])]]
    late = [rid for rid, (_, at) in final.items() if at - submitted[rid] > deadline_s]
    survivors_clean = all(code == 0 for name, code in exit_codes.items()
                          if name not in kills.values())
    return {"requests": args.requests, "terminal": len(final), "all_terminal": finished_in_time,
            "states": dict(states), "aborts_sent": len(aborted), "wrong_outputs": len(wrong),
            "duplicate_terminal_states": len(duplicates), "late": len(late),
            "deadline_s": deadline_s, "wall_s": wall_s, "killed": sorted(kills.values()),
            "exit_codes": exit_codes, "survivors_clean": survivors_clean,
            "ok": (finished_in_time and not wrong and not duplicates and not late
                   and survivors_clean)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--decoders", type=int, default=3)
    parser.add_argument("--prefillers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second")
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--abort-fraction", type=float, default=0.1)
    parser.add_argument("--kv-timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    result = run(parser.parse_args())
    if "--json" in sys.argv:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="load under failure")
        table.add_column("figure")
        table.add_column("value")
        for key, value in result.items():
            table.add_row(key, str(value))
        Console().print(table)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
