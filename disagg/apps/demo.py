"""`disagg demo`: one prefiller and N decoders as processes on this machine, a router, a live
view (S1, S2, S3, S4, S8).

Every request goes to the least-loaded decoder, which pins pages and asks the prefiller for the
KV; the prefiller streams it layer by layer over libfabric; the decoder decodes. The live view
shows each request's `RequestState` (waiting for KV with writes landed, running, finished),
its text, TTFT and tokens/s, and the transfer figures. `run_demo` returns the JSON the `--json`
flag prints.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import FailureCause, RequestState
from disagg.errors import ConfigError
from disagg.model.loading.registry import load_model
from disagg.model.loading.tokenizer import StreamDecoder, Tokenizer
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.preflight import check_cluster
from disagg.node.router import Router
from disagg.utils.trace import Tracer
from disagg.utils.trace_merge import merge_trace_dir, record_request

BUILTIN_PROMPTS = [
    "The three primary colors are",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Paris is the capital of",
    "The most important idea in computer science is",
    "Once upon a time, in a small village,",
]


@dataclass
class PromptSpec:
    """One request of the demo: text or token ids, and its own max_tokens if given."""

    text: str | None = None
    token_ids: list[int] | None = None
    max_tokens: int | None = None
    builtin: bool = False  # one of BUILTIN_PROMPTS


@dataclass
class DemoRequest:
    """What the demo tracks about one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int
    state: RequestState = RequestState.WAITING
    decoder: int = -1
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    submitted_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    kv_writes_received: int = 0
    kv_writes: int = 0
    kv_bytes: int = 0
    kv_wait_ms: float = 0.0
    cached_tokens: int = 0  # prompt tokens the decoder found in its prefix cache (X2)
    cause: FailureCause | None = None
    detail: str = ""
    stream: StreamDecoder | None = None
    draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted (S8)
    accepted_tokens: int = 0

    @property
    def done(self) -> bool:
        """Whether the request reached a terminal state."""
        return self.state.is_terminal()

    @property
    def ttft_ms(self) -> float | None:
        """Time from submission to the first token."""
        return (self.token_times[0] - self.submitted_at) * 1e3 if self.token_times else None

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) * 1e3 / (len(self.token_times) - 1)

    def as_json(self) -> dict[str, Any]:
        """The per-request object of `--json`."""
        return {"request_id": self.request_id, "prompt": self.prompt,
                "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                "text": self.text, "state": self.state.value, "decoder": self.decoder,
                "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "kv_writes": self.kv_writes,
                "kv_bytes": self.kv_bytes, "kv_wait_ms": self.kv_wait_ms,
                "cached_tokens": self.cached_tokens,
                "cause": self.cause.value if self.cause else None, "detail": self.detail,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}


def load_prompts(path: str | None) -> list[PromptSpec]:
    """Prompts from a JSON Lines file (`{"prompt": ...}` or `{"prompt_token_ids": [...]}`,
    optional `max_tokens`), a plain text file (one prompt per line), or the built-in set."""
    if path is None:
        return [PromptSpec(text=p, builtin=True) for p in BUILTIN_PROMPTS]
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"prompts file {path} does not exist")
    specs = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            specs.append(PromptSpec(text=line))
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("prompt_token_ids" in item):
            raise ConfigError(f"{path}:{number}: need exactly one of prompt, prompt_token_ids")
        max_tokens = item.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise ConfigError(f"{path}:{number}: max_tokens must be a whole number >= 1, got "
                              f"{max_tokens!r}")
        ids = item.get("prompt_token_ids")
        if ids is not None and (not isinstance(ids, list)
                                or any(type(t) is not int for t in ids)):
            raise ConfigError(f"{path}:{number}: prompt_token_ids must be a list of integers")
        specs.append(PromptSpec(item.get("prompt"), ids, max_tokens))
    if not specs:
        raise ConfigError(f"prompts file {path} has no prompts")
    return specs


def make_requests(specs: list[PromptSpec], tokenizer: Tokenizer | None, vocab_size: int,
                  max_tokens: int, max_request_tokens: int | None = None) -> list[DemoRequest]:
    """Tokenize and validate every prompt up front, so a bad one fails before any process;
    `max_request_tokens`: what a decoder can hold of one request (prompt plus output)."""
    if max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {max_tokens}")
    requests = []
    for i, spec in enumerate(specs):
        if spec.token_ids is not None:
            ids = spec.token_ids
        elif tokenizer is None and spec.builtin:
            # A random-weight preset has no tokenizer: its built-in prompts are their bytes.
            ids = [byte % vocab_size for byte in (spec.text or "").encode()]
        elif tokenizer is None:
            raise ConfigError("this model has no tokenizer: give prompt_token_ids")
        else:
            ids = tokenizer.encode(spec.text or "")
        if not ids or any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            raise ConfigError(f"prompt {i}: empty or token ids outside [0, {vocab_size})")
        budget = spec.max_tokens or max_tokens
        # The last generated token is sampled, never stored: it needs no slot.
        if max_request_tokens is not None and len(ids) + budget - 1 > max_request_tokens:
            raise ConfigError(f"prompt {i}: {len(ids)} tokens + {budget} to generate do not fit "
                              f"a decoder's {max_request_tokens} (--num-pages x --page-size, "
                              "or the model's context)")
        stream = StreamDecoder(tokenizer, skip_special_tokens=True) if tokenizer else None
        requests.append(DemoRequest(f"req-{i}", spec.text, list(ids), budget, stream=stream))
    return requests


def apply_event(request: DemoRequest, event: RequestEvent, now: float) -> None:
    """Fold one decoder event into the request's record."""
    request.state = event.state
    request.kv_writes_received = max(request.kv_writes_received, event.kv_writes_received)
    if event.kv_writes:
        request.kv_writes, request.kv_bytes = event.kv_writes, event.kv_bytes
        request.kv_wait_ms = event.kv_wait_ms
    request.cached_tokens = max(request.cached_tokens, event.num_cached_tokens)
    request.detail = event.detail or request.detail
    request.cause = event.cause or request.cause
    if event.num_draft_tokens:
        request.draft_tokens = event.num_draft_tokens
        request.accepted_tokens = event.num_accepted_tokens
    for token_id in event.token_ids:
        request.token_ids.append(token_id)
        request.token_times.append(now)
        if request.stream is not None:
            request.text += request.stream.push(token_id)
    if request.done and request.stream is not None:
        request.text += request.stream.flush()


def totals(requests: list[DemoRequest], wall_s: float) -> dict[str, Any]:
    """The `totals` object of `--json`."""
    tokens = sum(len(r.token_ids) for r in requests)
    kv_bytes = sum(r.kv_bytes for r in requests)
    ttfts = sorted(r.ttft_ms for r in requests if r.ttft_ms is not None)
    drafts = sum(r.draft_tokens for r in requests)
    accepted = sum(r.accepted_tokens for r in requests)
    failed = sum(r.state is RequestState.FINISHED_FAILED for r in requests)
    return {"requests": len(requests), "failed": failed,
            "output_tokens": tokens, "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "ttft_ms_p50": ttfts[len(ttfts) // 2] if ttfts else None,
            "kv_writes": sum(r.kv_writes for r in requests), "kv_bytes": kv_bytes,
            "cached_tokens": sum(r.cached_tokens for r in requests),
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else None}


def dtype_name(dtype: torch.dtype) -> str:
    """How the command line spells `dtype`: "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def trace_request(tracer: Tracer, request: DemoRequest, tokens_before: int,
                  clock: float) -> None:
    """Router-side trace of one event: new tokens, KV writes landed so far, the end.
    `clock` turns `time.monotonic()` into `time.time()`, the clock every node traces on."""
    rid = request.request_id
    for index in range(tokens_before, len(request.token_ids)):
        kind = "first_token" if index == 0 else "token"
        record_request(tracer, rid, kind, request.token_times[index] + clock, index=index)
    landed = request.kv_writes or request.kv_writes_received
    if landed:
        tracer.counter("kv_writes_landed", **{rid: landed})
    if request.done:
        end = time.monotonic() + clock
        record_request(tracer, rid, "done", end, state=request.state.value)
        tracer.end(rid, end_s=end, decoder=request.decoder, ttft_ms=request.ttft_ms,
                   tpot_ms=request.tpot_ms, tokens=len(request.token_ids))


def run_demo(cluster_config: ClusterConfig, specs: list[PromptSpec], max_tokens: int,
             temperature: float = 0.0, view: Any = None, timeout_s: float = 600.0,
             exit_codes: bool = False, trace: str | None = None,
             on_node: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """Start the cluster, serve every prompt, stop the cluster; returns the JSON result.

    `view`, if given, is called with the request list after every event (the live display).
    With `exit_codes`, the result also holds each node's exit code (0: it shut down clean)
    and the tail of its log. With `trace`, every process records a Chrome trace and one
    merged trace (router, prefiller, decoders on one clock) is written to that path.
    `on_node` hears each node start and become ready (`LocalCluster`).
    """
    if trace is not None and not Path(trace).resolve().parent.is_dir():
        raise ConfigError(f"--trace {trace}: directory {Path(trace).resolve().parent} does not "
                          "exist")  # checked now: the merged trace is written at the very end
    node = cluster_config.node
    check_cluster(cluster_config)  # before the model loads: a missing provider is one line
    loaded = load_model(node.model)
    limit = min(node.cache.num_tokens, loaded.config.max_position_embeddings)
    requests = make_requests(specs, loaded.tokenizer, loaded.config.vocab_size, max_tokens,
                             limit)
    by_id = {r.request_id: r for r in requests}
    trace_dir = tempfile.mkdtemp(prefix="disagg-trace-") if trace else None
    tracer = Tracer(f"{trace_dir}/router.json" if trace_dir else None, "router",
                    otlp_endpoint=node.otlp_endpoint)
    clock = time.time() - time.monotonic()
    try:
        with LocalCluster(cluster_config.with_node(trace=trace_dir), on_node=on_node) as cluster:
            router = Router(cluster.decoder_addresses, cluster_config.router_config())
            started = time.monotonic()
            for request in requests:
                request.submitted_at = time.monotonic()
                # The request's span, where its trace starts (X7a): the decoder's joins it.
                context = tracer.open(request.request_id, "request",
                                      start_s=request.submitted_at + clock,
                                      track=request.request_id, request_id=request.request_id)
                request.decoder = router.route(Submit(
                    request.request_id, request.prompt_token_ids, request.max_tokens,
                    temperature, traceparent=context))
                record_request(tracer, request.request_id, "submit",
                               request.submitted_at + clock, decoder=request.decoder)
            while not all(r.done for r in requests):
                event = router.events.get(timeout=timeout_s)
                request = by_id[event.request_id]
                tokens_before = len(request.token_ids)
                apply_event(request, event, time.monotonic())
                trace_request(tracer, request, tokens_before, clock)
                if view is not None:
                    view(requests)
            wall_s = time.monotonic() - started
            router.close()
            metrics = cluster.scrape_metrics()
            processes = cluster.process_table()
        tracer.close()  # before the merge reads its file
        if trace_dir is not None and trace is not None:
            merge_trace_dir(trace_dir, trace,
                            expected=[name for name, _ in cluster_config.nodes()])
    finally:
        tracer.close()  # a no-op once closed; on failure it flushes what was recorded
        if trace_dir is not None:
            shutil.rmtree(trace_dir, ignore_errors=True)
    # The KV totals are what the nodes counted, pages in the cache's own dtype.
    result = {"model": node.model, "decoders": cluster_config.num_decoders,
              "kv_layout": node.cache.kv_layout, "dtype": dtype_name(node.dtype),
              "kv_dtype": dtype_name(node.cache.dtype), "provider": node.provider,
              "requests": [r.as_json() for r in requests], "totals": totals(requests, wall_s),
              "metrics": metrics, "processes": processes}
    if exit_codes:
        result["exit_codes"] = cluster.exit_codes()
        result["logs"] = {name: lines[-8:] for name, lines in cluster.logs.items()}
    return result
