"""`OtlpCollector`: an OTLP/gRPC trace collector in the test process (a gRPC server on a free loopback port) that
keeps every span it receives, for tests of what services export with `--otlp-endpoint`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporter's resource `service.name`
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self._spans += [ReceivedSpan(str(resource.get("service.name")), s.name, s.trace_id.hex(),
                                                 s.span_id.hex(), s.parent_span_id.hex(),
                                                 {a.key: _value(a.value) for a in s.attributes}) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> OtlpCollector:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(None)
