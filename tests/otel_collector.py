"""A real OTLP trace collector for tests: OpenTelemetry's gRPC `TraceService` on a free 127.0.0.1 port, keeping
every span it is sent (decoded from the wire, as a collector such as Jaeger receives them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector got it: ids as ints (0: none), attributes as Python values."""

    name: str
    kind: int  # opentelemetry.proto's Span.SpanKind
    trace_id: int
    span_id: int
    parent_span_id: int
    start_time_unix_nano: int
    end_time_unix_nano: int
    attributes: dict[str, Any]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []

    def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        received = [
            _received(span)
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPCollector:
    """The collector at `endpoint` (`http://127.0.0.1:PORT`, what `--otlp-traces-endpoint` takes)."""

    def __init__(self) -> None:
        self._service = _TraceService()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._service, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server.start()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._service.lock:
            return list(self._service.spans)

    def stop(self) -> None:
        self._server.stop(grace=None)


@contextlib.contextmanager
def running_collector() -> Iterator[OTLPCollector]:
    collector = OTLPCollector()
    try:
        yield collector
    finally:
        collector.stop()


def _received(span: Span) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        kind=span.kind,
        trace_id=int.from_bytes(span.trace_id, "big"),
        span_id=int.from_bytes(span.span_id, "big"),
        parent_span_id=int.from_bytes(span.parent_span_id, "big"),
        start_time_unix_nano=span.start_time_unix_nano,
        end_time_unix_nano=span.end_time_unix_nano,
        attributes={item.key: _value(item.value) for item in span.attributes},
    )


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(each) for each in value.array_value.values)
    return getattr(value, kind) if kind else None
