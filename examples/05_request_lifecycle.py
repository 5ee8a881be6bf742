"""Step 5: the life of one request, from the router to its last token (S2, S3, S4, S8).

Starts a prefiller and a decoder of the `tiny` model as real processes talking over libfabric
(the tcp provider on loopback), sends one 40-token prompt, and prints one timeline of what
happened where: the router's events, and the spans and marks each node wrote to its trace.
Pairs with docs/tutorials/05-request-lifecycle.md. Runs on a CPU in a few seconds.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.router import Router

PROMPT = list(range(100, 140))  # 40 token ids: the tiny preset has no tokenizer
Timeline = list[tuple[float, str, str]]  # (time.time(), where, what)


def describe_event(event: RequestEvent) -> str:
    """One line for a router event (`event.state` is a `RequestState`)."""
    if event.state is RequestState.WAITING_FOR_KV:
        return f"waiting for KV, {event.kv_writes_received} writes landed so far"
    if event.state is RequestState.RUNNING and event.kv_writes:
        return (f"counter fired: {event.kv_writes} writes, {event.kv_bytes} bytes, "
                f"{event.kv_wait_ms:.1f} ms after the KVRequest left")
    if event.token_ids:
        return f"{event.state.value}: token {event.token_ids[0]}"
    return event.state.value


def describe_trace(node: str, event: dict) -> str | None:
    """One line for a trace event of the prefiller or the decoder (None: not shown)."""
    args = event.get("args", {})
    name = event["name"]
    if name == "layer":  # the poller saw the counter bump; this layer's writes go out now
        return f"forward {args['forward']}: layer {args['layer']} done, its page writes posted"
    if name == "layer_writes":  # a span from posting to completion: shown at its end
        return f"layer {args['layer']}'s writes completed ({event['dur'] / 1e3:.2f} ms)"
    if name == "step":
        kind = "prefill chunk" if node.startswith("prefill") else "decode step"
        return f"{kind} starts: {args['num_tokens']} tokens, {args['num_seqs']} request(s)"
    if name in ("queue", "prefill", "transfer_tail", "kv_wait"):
        return f"{name} starts ({event['dur'] / 1e3:.1f} ms)"
    return None


def serve(router: Router, request_id: str, timeline: Timeline,
          prompt: list[int] = PROMPT) -> None:
    """Send `prompt` and record the router's events until the request ends."""
    router.route(Submit(request_id, prompt, max_tokens=4))
    timeline.append((time.time(), "router", f"submit {request_id}: {len(prompt)} tokens"))
    while True:
        event = router.events.get(timeout=60)
        timeline.append((time.time(), "router", describe_event(event)))
        if event.state.is_terminal():
            return


def main() -> None:
    with tempfile.TemporaryDirectory() as trace_dir:
        # Every node writes its Chrome trace into trace_dir when it exits.
        config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=16,
                                            num_pages=64, chunk_size=16, trace=trace_dir)
        timeline: Timeline = []
        with LocalCluster(config) as cluster:
            router = Router(cluster.decoder_addresses)
            # A warm-up request first, so the one-time costs of each node's first steps stay
            # out of the timeline. (Not the fabric connection: the prefiller opened that at
            # handshake, with `TransferEngine.connect`.) Another prompt: the prefix cache
            # would otherwise hand req-1 the warm-up's pages (tutorial 11).
            serve(router, "warm-up", [], prompt=list(range(200, 240)))
            time.sleep(0.1)
            start = time.time()
            serve(router, "req-1", timeline)
            router.close()
        for path in sorted(Path(trace_dir).glob("*.json")):
            for event in json.loads(path.read_text())["traceEvents"]:
                line = describe_trace(path.stem, event) if event["ph"] in "Xi" else None
                if line is None:
                    continue
                at = (event["ts"] + (event["dur"] if event["name"] == "layer_writes" else 0)) / 1e6
                if at >= start:
                    timeline.append((at, path.stem, line))

    print(f"one request through a prefiller and a decoder ({config.node.model}, page size "
          f"{config.node.cache.page_size}, chunk size {config.node.scheduler.chunk_size}):")
    for at, where, line in sorted(timeline):
        print(f"{(at - start) * 1e3:8.1f} ms  {where:<10} {line}")


if __name__ == "__main__":
    main()
