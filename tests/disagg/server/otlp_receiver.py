"""A stand-in OTLP/HTTP collector for tests: it decodes every `POST /v1/traces` with the
OpenTelemetry protocol's own messages and keeps the spans, with the process each came from."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    process: str  # the resource's service.instance.id: the node id, or "front-door"
    pid: int
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root


class OTLPReceiver:
    """Listens on 127.0.0.1 (any free port) until `close()`."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value for a in resource_spans.resource.attributes}
            process = attributes["service.instance.id"].string_value
            pid = attributes["process.pid"].int_value
            for scope in resource_spans.scope_spans:
                with self._lock:
                    self.spans += [ReceivedSpan(s.name, process, pid, s.trace_id.hex(),
                                                s.span_id.hex(), s.parent_span_id.hex())
                                   for s in scope.spans]

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
