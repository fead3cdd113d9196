#!/usr/bin/env python3
"""An OTLP/HTTP traces receiver for the tests.

Decodes each export with OpenTelemetry's own protobuf definitions (the opentelemetry-proto
package) and appends its spans to FILE, one JSON object per line; a body that does not
decode is answered 400, as a collector would. Prints the port it listens on (loopback),
then serves until killed.

    otlp_receiver.py FILE
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OUT = sys.argv[1]


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attributes(attrs):
    return {a.key: value(a.value) for a in attrs}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path != "/v1/traces":
            return self.answer(404, b"")
        if self.headers.get("Content-Type") != "application/x-protobuf":
            return self.answer(415, b"")
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception as e:  # a malformed export
            return self.answer(400, str(e).encode())
        lines = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    lines.append(json.dumps({
                        "service": resource.get("service.name"),
                        "scope": ss.scope.name,
                        "name": span.name,
                        "kind": span.kind,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "attributes": attributes(span.attributes),
                        "events": [e.name for e in span.events],
                        "status": span.status.code,
                        "private_token": self.headers.get("Private-Token"),
                    }))
        with open(OUT, "a") as f:
            f.write("".join(line + "\n" for line in lines))
        self.answer(200, ExportTraceServiceResponse().SerializeToString())

    def answer(self, code, body):
        self.send_response(code)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
