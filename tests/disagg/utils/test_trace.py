"""The tracer (X7a): OpenTelemetry spans, the W3C context between processes, and the Perfetto
file made of the same spans. Checked with the SDK's in-memory exporter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg.errors import ConfigError
from disagg.utils.otlp import RequestSpansOnly, traces_url
from disagg.utils.trace import Tracer, context_of

T0 = 1_700_000_000.0
GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _recording(name: str) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracer(process_name=name, exporters=[exporter]), exporter


def test_a_context_passed_on_makes_one_trace_with_parents_right() -> None:
    """Three tracers (three processes) hand a request's context along as text: one trace,
    each span's parent the span that sent it."""
    door, door_spans = _recording("front-door")
    decoder, decoder_spans = _recording("decode-0")
    prefiller, prefiller_spans = _recording("prefill-0")
    with door.server_span("POST /v1/completions") as http:
        sent = door.open("r", "route")  # the current span is its parent
        door.end("r")
    here = decoder.open("r", "request", parent=sent)
    prefiller.complete("prefill", T0, T0 + 0.01, parent=here)
    decoder.end("r")
    door.close(), decoder.close(), prefiller.close()
    spans = {s.name: s for s in [*door_spans.get_finished_spans(),
                                 *decoder_spans.get_finished_spans(),
                                 *prefiller_spans.get_finished_spans()]}
    assert {s.context.trace_id for s in spans.values()} == {http.get_span_context().trace_id}
    assert spans["route"].parent.span_id == spans["POST /v1/completions"].context.span_id
    assert spans["request"].parent.span_id == spans["route"].context.span_id
    assert spans["prefill"].parent.span_id == spans["request"].context.span_id
    assert spans["request"].resource.attributes["service.instance.id"] == "decode-0"


def test_the_perfetto_file_holds_the_same_spans(tmp_path: Path) -> None:
    """What the exporter gets and what the file holds are one set of spans, times in µs."""
    exporter = InMemorySpanExporter()
    tracer = Tracer(str(tmp_path / "t.json"), "prefill-0", exporters=[exporter])
    tracer.complete("prefill", T0, T0 + 0.25, request_id="r")
    tracer.instant("layer", at_s=T0 + 0.1, layer=3)
    tracer.close()
    events = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
              if e["ph"] != "M"]
    assert sorted(e["name"] for e in events) == sorted(
        s.name for s in exporter.get_finished_spans())
    prefill = next(e for e in events if e["name"] == "prefill")
    assert (prefill["ts"], prefill["dur"], prefill["args"]) == (T0 * 1e6, 250_000, {
        "request_id": "r"})
    assert next(e for e in events if e["name"] == "layer")["ph"] == "i"


def _file_events(path: Path) -> list[dict[str, object]]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] != "M"]


def _process_and_request_spans(tracer: Tracer) -> None:
    tracer.complete("step", T0, T0 + 0.003, num_tokens=5, track="steps")
    tracer.instant("layer", at_s=T0 + 0.001, layer=3, forward=None)
    parent = tracer.open("r1", "kv_request", start_s=T0, request_id="r1")
    tracer.complete("layer_writes", T0, T0 + 0.002, parent=parent, layer=3)
    tracer.end("r1", end_s=T0 + 0.004)
    tracer.close()


def test_process_spans_written_directly_match_the_sdks(tmp_path: Path) -> None:
    """With the Perfetto file the only taker of process spans, they skip the SDK and land as
    the SDK's spans do (same events, times, args, tracks), next to the request's spans."""
    direct, through_sdk = tmp_path / "direct.json", tmp_path / "sdk.json"
    _process_and_request_spans(Tracer(str(direct), "prefill-0"))
    # Any processor handed in sees every span: the tracer then takes the SDK's way for all.
    _process_and_request_spans(Tracer(str(through_sdk), "prefill-0",
                                      processors=[SimpleSpanProcessor(InMemorySpanExporter())]))
    by_name = {e["name"]: e for e in _file_events(through_sdk)}
    assert {e["name"]: e for e in _file_events(direct)} == by_name
    assert by_name["layer"]["ph"] == "i" and by_name["step"]["dur"] == 3000


def test_process_spans_skip_the_sdk_and_request_spans_do_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process span written directly makes no SDK span; a span in a request's trace does."""
    made: list[str] = []
    start = Tracer._start

    def counting(*args: object, **kwargs: object) -> object:
        made.append(str(args[1]))
        return start(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Tracer, "_start", staticmethod(counting))
    _process_and_request_spans(Tracer(str(tmp_path / "t.json"), "prefill-0"))
    assert made == ["kv_request", "layer_writes"]


def test_a_malformed_traceparent_starts_a_new_trace() -> None:
    """A peer's bad context costs its link, nothing else: the span is a root."""
    tracer, spans = _recording("decode-0")
    tracer.complete("kv_wait", T0, T0 + 1, parent="00-not-a-trace")
    tracer.close()
    (span,) = spans.get_finished_spans()
    assert span.parent is None and span.context.is_valid
    assert context_of("00-not-a-trace") is None and context_of(GOOD) is not None


def test_a_disabled_tracer_hands_a_good_context_on_and_drops_a_bad_one() -> None:
    """A decoder that records nothing still lets the prefiller join the router's trace."""
    tracer = Tracer()
    assert tracer.open("r", "request", parent=GOOD) == GOOD
    assert tracer.open("r", "request", parent="garbage" * 1000) == ""
    assert not tracer.enabled and tracer.num_open == 0


def test_closing_ends_what_is_still_open() -> None:
    """A span left open is ended at close, marked unfinished; none stays counted."""
    tracer, spans = _recording("decode-0")
    tracer.open("r", "request")
    assert tracer.num_open == 1
    tracer.close()
    (span,) = spans.get_finished_spans()
    assert span.attributes["disagg.unfinished"] is True and tracer.num_open == 0


def test_only_requests_spans_go_over_otlp() -> None:
    """An engine step (no parent) stays local; a request's span and its children go."""
    exporter = InMemorySpanExporter()  # in the place of OTLP's exporter
    tracer = Tracer(process_name="decode-0",
                    processors=[RequestSpansOnly(SimpleSpanProcessor(exporter))])
    tracer.complete("step", T0, T0 + 0.01)
    context = tracer.open("r", "request")
    tracer.complete("kv_wait", T0, T0 + 0.01, parent=context)
    tracer.end("r")
    tracer.close()
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["kv_wait", "request"]


def test_otlp_endpoints_are_checked() -> None:
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://tempo:4318/otlp/v1/traces") == "https://tempo:4318/otlp/v1/traces"
    with pytest.raises(ConfigError, match="--otlp-endpoint"):
        traces_url("127.0.0.1:4318")


def test_a_missing_exporter_is_refused_before_anything_loads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the otel extra, --otlp-endpoint is one clear error (a node checks it in its
    config, before its model loads)."""
    import disagg.utils.otlp as otlp

    monkeypatch.setattr(otlp, "EXPORTER_PACKAGE", "opentelemetry.no_such.exporter")
    with pytest.raises(ConfigError, match=r"disagg\[otel\]"):
        otlp.check_otlp_endpoint("http://127.0.0.1:4318")
