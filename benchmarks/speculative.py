"""Speculative decoding on this machine: acceptance, tokens per target forward, decode tokens/s.

One request at a time (batch 1, where speculation pays off), greedy, the built-in demo prompts
on SmolLM2-135M (fp32, CPU). Configurations: no speculation, early-exit drafts of several
depths, the (random-init) MTP head, and that head with its drafts replaced by the right tokens
(`mtp+oracle`: what a well-trained head of the same cost would give). Measured: the acceptance
rate (accepted / verified drafts), tokens per target forward during decode, and decode tokens/s
(tokens after the first, over the time after the first). Greedy outputs must equal the
non-speculative run's; the `same` column says so. Waits for a quiet machine first, and keeps
the fastest of `--reps` round-robin runs of each configuration (the least disturbed by other
processes; the share of CPU other processes used during it is reported too).
Run: `python benchmarks/speculative.py [--model smollm2-135m] [--max-tokens 48] [--json]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `benchmarks/disagg.py` shares the package's name: the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from pinned_cluster import CpuMeter, wait_for_quiet  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from disagg.apps.demo import BUILTIN_PROMPTS  # noqa: E402
from disagg.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,  # noqa: E402
)
from disagg.engine.llm_engine import build_engine  # noqa: E402
from disagg.engine.request import SamplingParams  # noqa: E402
from disagg.model.loading.registry import LoadedModel, load_model  # noqa: E402
from disagg.speculative.speculator import Speculator, build_speculative_engine  # noqa: E402


def configurations(num_layers: int) -> list[tuple[str, SpeculativeConfig | None]]:
    """No speculation; early exits (`exit@L`: the first L layers) at half the depth, at 5/6 of
    it and one layer short of the default (all but the last two), several k; the MTP head."""
    deep = max(1, num_layers - 2)
    configs: list[tuple[str, SpeculativeConfig | None]] = [("none", None)]
    plan = {(max(1, num_layers // 2), 2), (max(1, num_layers * 5 // 6), 2), (deep, 1),
            (deep, 2), (deep, 4)}
    configs += [(f"exit@{layers}", SpeculativeConfig("early-exit", k, draft_layers=layers))
                for layers, k in sorted(plan)]
    configs += [("mtp", SpeculativeConfig("mtp", 2)), ("mtp+oracle", SpeculativeConfig("mtp", 2)),
                ("mtp+oracle", SpeculativeConfig("mtp", 4))]
    return configs


class OracleDrafts:
    """The MTP head runs and costs what it costs, but its drafts are replaced by the target's
    own greedy continuation: the speed a perfectly trained head of this size would give."""

    def __init__(self, proposer: Any, truth: dict[tuple[int, ...], list[int]]) -> None:
        self.proposer, self.truth = proposer, truth

    def observe(self, *args: Any) -> None:
        self.proposer.observe(*args)

    def propose(self, requests: list[Any], num_drafts: list[int], choose: Any
                ) -> list[list[int]]:
        drafts = self.proposer.propose(requests, num_drafts, choose)
        for request, tokens in zip(requests, drafts, strict=True):
            done = len(request.output_token_ids)
            tokens[:] = self.truth[tuple(request.prompt_token_ids)][done:done + len(tokens)]
        return drafts


def measure(loaded: LoadedModel, spec: SpeculativeConfig | None, prompts: list[list[int]],
            max_tokens: int, truth: dict[tuple[int, ...], list[int]] | None = None
            ) -> dict[str, Any]:
    """Serve each prompt alone; totals of decode tokens, decode forwards, time and drafts.
    With `truth`, the drafts are the reference tokens (see `OracleDrafts`)."""
    config = EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=256),
                          SchedulerConfig(chunk_size=512, max_num_batched_tokens=512))
    engine = (build_engine(config, loaded.state_dict) if spec is None
              else build_speculative_engine(config, loaded.state_dict, spec))
    speculator = engine.finisher if isinstance(engine.finisher, Speculator) else None
    if speculator is not None and truth is not None:
        speculator.proposer = OracleDrafts(speculator.proposer, truth)  # type: ignore[assignment]
    tokens, forwards, seconds, outputs = 0, 0, 0.0, []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    meter = CpuMeter([os.getpid()])
    for prompt in prompts:
        request = engine.add_request(prompt, params)
        steps = engine.num_steps
        engine.step()  # the prompt in one chunk: the first token (and the first drafts)
        start, first_step = time.perf_counter(), engine.num_steps
        while engine.has_unfinished():
            engine.step()
        seconds += time.perf_counter() - start
        tokens += len(request.output_token_ids) - 1
        forwards += engine.num_steps - first_step
        outputs.append(request.output_token_ids)
        assert first_step == steps + 1
    stats = speculator.stats if speculator is not None else None
    return {"decode_tokens": tokens, "target_forwards": forwards, "decode_s": seconds,
            "others_cpu_share": meter.read()["others"],
            "decode_tokens_per_s": tokens / seconds,
            "tokens_per_forward": tokens / forwards,
            "drafted": stats.drafted if stats else 0, "accepted": stats.accepted if stats else 0,
            "acceptance_rate": stats.acceptance_rate if stats else None, "outputs": outputs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quiet-wait-s", type=float, default=120.0)
    parser.add_argument("--reps", type=int, default=3, help="best of: the least disturbed run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    vocab = loaded.config.vocab_size
    prompts = [loaded.tokenizer.encode(text) if loaded.tokenizer else
               [b % vocab for b in text.encode()] for text in BUILTIN_PROMPTS]
    quiet = wait_for_quiet([], args.quiet_wait_s)
    configs = configurations(loaded.config.num_layers)
    # Round-robin over the configurations, so a burst of other work hits them all alike.
    best: list[dict[str, Any]] = [{} for _ in configs]
    truth: dict[tuple[int, ...], list[int]] = {}
    for rep in range(args.reps):
        for i, (name, spec) in enumerate(configs):
            row = measure(loaded, spec, prompts, args.max_tokens,
                          truth if name.endswith("oracle") else None)
            if rep == 0 and spec is None:
                truth = dict(zip(map(tuple, prompts), row["outputs"], strict=True))
            if row["decode_tokens_per_s"] > best[i].get("decode_tokens_per_s", 0.0):
                best[i] = row
    rows = []
    baseline = best[0]["outputs"]
    for (name, spec), row in zip(configs, best, strict=True):
        outputs = row.pop("outputs")
        rows.append({"draft": name, "k": spec.num_draft_tokens if spec else 0,
                     "same_tokens": outputs == baseline, **row})
    base_speed = rows[0]["decode_tokens_per_s"]
    for row in rows:
        row["speedup"] = row["decode_tokens_per_s"] / base_speed
    result = {"model": args.model, "threads": args.threads, "max_tokens": args.max_tokens,
              "prompts": len(prompts), "quiet": quiet.quiet,
              "others_cpu_share": quiet.others, "rows": rows}
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table(title=f"speculative decoding, {args.model}, batch 1, {args.threads} threads "
                        f"({'quiet' if quiet.quiet else 'NOT quiet'} machine)")
    for column in ("draft", "k", "acceptance", "tokens/forward", "decode tok/s", "speedup",
                   "same", "others' CPU"):
        table.add_column(column, justify="left" if column == "draft" else "right")
    for r in rows:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        table.add_row(r["draft"], str(r["k"]), rate, f"{r['tokens_per_forward']:.2f}",
                      f"{r['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                      str(r["same_tokens"]), f"{r['others_cpu_share']:.0%}")
    Console().print(table)


if __name__ == "__main__":
    main()
