"""A decoder's spans of a request (X7a): under the router's span, the request's own, and
under it admission, kv_wait, first_token_sent and decode; a fork's join its parent's; the span
ends once, with the state the request ended in."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg.engine.forking import fork_request_id
from disagg.engine.request import Request, RequestState, SamplingParams
from disagg.node.request_spans import RequestSpans
from disagg.utils.trace import Tracer

ROUTER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _spans() -> tuple[RequestSpans, Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracer = Tracer(process_name="decode-0", exporters=[exporter])
    return RequestSpans(tracer), tracer, exporter


def test_a_request_life_is_one_span_with_its_steps_under_it() -> None:
    spans, tracer, exporter = _spans()
    request = Request("r", [1, 2, 3], SamplingParams(n=2))
    spans.admitted(request, ROUTER)
    spans.kv_arrived(request, 0.0)
    for index in (0, 1):  # each choice's tokens: one first token
        fork = Request(fork_request_id("r", index), [1, 2, 3], parent_id="r", index=index,
                       traceparent=request.traceparent)
        spans.token(fork)
    spans.ended(fork, RequestState.FINISHED_LENGTH)
    assert tracer.num_open == 0
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(finished) == ["admission", "decode", "first_token_sent", "kv_wait", "request"]
    root = finished.pop("request")
    assert f"{root.parent.span_id:016x}" == "b7ad6b7169203331"
    assert root.attributes["state"] == "finished_length"
    assert {s.parent.span_id for s in finished.values()} == {root.context.span_id}


def test_a_refused_request_ends_its_span() -> None:
    spans, tracer, exporter = _spans()
    request = Request("r", [1, 2, 3])
    spans.admitted(request, "")  # no router trace: the decoder starts one
    spans.refused("r", "too long")
    [span] = exporter.get_finished_spans()
    assert span.parent is None and span.attributes["detail"] == "too long"
    assert tracer.num_open == 0
