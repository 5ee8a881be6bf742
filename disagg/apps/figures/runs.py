"""The measured runs behind the tutorials' pictures: one node, then disaggregated (S1-S4).

Three requests (a short one, then two long prompts) run twice on the `small` preset: on one
node with mixed batches (in this process), and disaggregated (`run_demo` with a trace: one
prefiller and one decoder process over libfabric's tcp provider). From those runs come the
mixed-versus-disaggregated timelines, one request's lifecycle and the layer-by-layer
transfer timeline; the NHD/HND and TP pictures come from `PagedKVCache.page_segments` and
the transfer planner. Nothing is made up: every time drawn was measured. Matplotlib (Agg).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# (name, prompt tokens, output tokens): a chatty short request and two long prompts.
WORKLOAD = [("A", 48, 64), ("B", 1536, 16), ("C", 1536, 16)]
CHUNK_SIZE = 256  # prefill chunk and token budget per step, on both setups


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: when it ran (ms from the start) and what it held."""

    start_ms: float
    end_ms: float
    prefill_tokens: int
    decodes: int


@dataclass
class RequestTimes:
    """One request as a client sees it: submitted, then a token at each time."""

    name: str
    submit_ms: float
    token_ms: list[float] = field(default_factory=list)


@dataclass
class Timeline:
    """A run: its requests and, per engine ("node" lane), its steps."""

    title: str
    requests: list[RequestTimes]
    lanes: dict[str, list[Step]]


def workload_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The token ids of WORKLOAD's prompts (random, fixed seed)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist()
            for _, n, _ in WORKLOAD]


def run_mixed(model: str) -> Timeline:
    """Serve WORKLOAD on one in-process engine, prefill chunks and decodes batched together."""
    from disagg.config import CacheConfig, EngineConfig, SchedulerConfig
    from disagg.engine.llm_engine import build_engine
    from disagg.engine.request import SamplingParams
    from disagg.model.loading.registry import load_model

    loaded = load_model(model)
    engine = build_engine(EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=512),
                                       SchedulerConfig(chunk_size=CHUNK_SIZE,
                                                       max_num_batched_tokens=CHUNK_SIZE)),
                          loaded.state_dict)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each node of the disaggregated run
    try:
        start = time.perf_counter()
        requests = {engine.add_request(prompt, SamplingParams(max_tokens=out)).request_id:
                    RequestTimes(name, 0.0)
                    for (name, _, out), prompt in zip(WORKLOAD, workload_prompts(
                        loaded.config.vocab_size), strict=True)}
        steps = []
        while engine.has_unfinished():
            step_start = (time.perf_counter() - start) * 1e3
            events = engine.step()
            now = (time.perf_counter() - start) * 1e3
            batch = engine.last_batch
            assert batch is not None
            decodes = sum(chunk.is_decode for chunk in batch.chunks)
            steps.append(Step(step_start, now, batch.num_tokens - decodes, decodes))
            for event in events:
                requests[event.request.request_id].token_ms.append(now)
    finally:
        torch.set_num_threads(threads)
    return Timeline("one node: prefill chunks and decodes share every step",
                    list(requests.values()), {"node": steps})


def run_disaggregated(model: str, trace_path: Path) -> dict[str, Any]:
    """Serve WORKLOAD with one prefiller and one decoder process; returns the merged trace."""
    from disagg.apps.demo import PromptSpec, run_demo
    from disagg.model.loading.registry import load_model
    from disagg.node.cluster_config import ClusterConfig

    vocab_size = load_model(model).config.vocab_size
    specs = [PromptSpec(token_ids=prompt, max_tokens=out) for (_, _, out), prompt
             in zip(WORKLOAD, workload_prompts(vocab_size), strict=True)]
    config = ClusterConfig.from_options(model=model, num_decoders=1, page_size=16,
                                        chunk_size=CHUNK_SIZE)
    run_demo(config, specs, max_tokens=max(out for _, _, out in WORKLOAD), trace=str(trace_path))
    return json.loads(trace_path.read_text())


def timeline_from_trace(trace: dict[str, Any]) -> Timeline:
    """The disaggregated run as a `Timeline`: tokens as the router saw them, node steps."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    submits = [e for e in events if e["name"] == "submit"]
    origin = min(e["ts"] for e in submits)
    requests = {}
    for event in sorted(submits, key=lambda e: e["args"]["request_id"]):
        index = int(event["args"]["request_id"].removeprefix("req-"))
        requests[event["args"]["request_id"]] = RequestTimes(
            WORKLOAD[index][0], (event["ts"] - origin) / 1e3)
    for event in sorted((e for e in events if e["ph"] != "M"), key=lambda e: e["ts"]):
        if event["name"] in ("first_token", "token"):
            requests[event["args"]["request_id"]].token_ms.append((event["ts"] - origin) / 1e3)
    lanes: dict[str, list[Step]] = {"prefiller": [], "decoder": []}
    for event in events:
        if event["name"] == "step" and event["ph"] == "X":
            lane = "prefiller" if names[event["pid"]].startswith("prefill") else "decoder"
            decodes = 0 if lane == "prefiller" else event["args"]["num_seqs"]
            start = (event["ts"] - origin) / 1e3
            lanes[lane].append(Step(start, start + event["dur"] / 1e3,
                                    event["args"]["num_tokens"] - decodes, decodes))
    cores = os.cpu_count()
    return Timeline("disaggregated: one prefiller process feeds one decoder process (here both "
                    f"share this machine's {cores} CPU cores)", list(requests.values()), lanes)
