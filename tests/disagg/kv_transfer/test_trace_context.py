"""The prefiller's spans of a request join the decoder's trace (X7a): the `KVRequest`
carries the decoder's span context, and every span the prefiller records for the request
(its `kv_request`, and under it each chunk, each layer's writes, the TTFT split) hangs
under it."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg.kv_transfer.messages import KVRequest
from disagg.utils.perfetto import PROCESS_SCOPE, SCOPE
from disagg.utils.trace import Tracer
from tests.disagg.kv_transfer.messenger_harness import Harness, random_prompt

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
DECODER_SPAN = "b7ad6b7169203331"


def test_the_prefillers_spans_hang_under_the_decoders_request_span() -> None:
    exporter = InMemorySpanExporter()
    harness = Harness(prefill_tracer=Tracer(process_name="prefill-0", exporters=[exporter]))
    try:
        request = harness.submit(random_prompt(12), traceparent=f"00-{TRACE_ID}-{DECODER_SPAN}-01")
        harness.run_to_end(request)
        harness.check_clean()
    finally:
        harness.close()
    [asked] = [m for m in harness.to_prefiller if isinstance(m, KVRequest)]
    assert asked.traceparent == request.traceparent
    spans = [s for s in exporter.get_finished_spans()  # the engine's steps are the process's
             if s.attributes.get(SCOPE) != PROCESS_SCOPE]
    [kv_request] = [s for s in spans if s.name == "kv_request"]
    assert f"{kv_request.parent.span_id:016x}" == DECODER_SPAN
    assert {f"{s.context.trace_id:032x}" for s in spans} == {TRACE_ID}
    children = [s for s in spans if s is not kv_request]
    assert {s.parent.span_id for s in children} == {kv_request.context.span_id}
    names = [s.name for s in children]
    assert names.count("prefill_chunk") == 3  # 11 prefilled tokens in chunks of 5
    assert {"layer_writes", "queue", "prefill", "transfer_tail"} <= set(names)
