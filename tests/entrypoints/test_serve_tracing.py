"""`kvflow serve --otlp-traces-endpoint URL`: every request ends an `llm_request` span at a real OTLP collector, in
the trace of the `traceparent` header it came with (streamed or not), named after the served model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvflow.testing.waiting import wait_until
from kvflow.tracing import SpanAttributes
from tests.entrypoints.server import HASH_SERVER, RemoteServer, running_server
from tests.otel_collector import OTLPCollector, ReceivedSpan, running_collector

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"
SPAN_KIND_SERVER = 2  # opentelemetry.proto's Span.SpanKind


@pytest.fixture(scope="module")
def collector() -> Iterator[OTLPCollector]:
    with running_collector() as running:
        yield running


@pytest.fixture(scope="module")
def server(collector: OTLPCollector) -> Iterator[RemoteServer]:
    args = [*HASH_SERVER, "--served-model-name", "traced-hash"]
    # Export batches every 10 ms (default 5000); give up on a collector that went away after 1 s (default 10).
    env = {"OTEL_BSP_SCHEDULE_DELAY": "10", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
    with running_server(*args, "--otlp-traces-endpoint", collector.endpoint, env=env) as running:
        yield running


def span_of(collector: OTLPCollector, request_id: str) -> ReceivedSpan:
    """The one span the collector received for `request_id`, once it has."""

    def spans() -> list[ReceivedSpan]:
        return [
            span
            for span in collector.spans
            if span.attributes[SpanAttributes.GEN_AI_REQUEST_ID] == request_id
        ]

    wait_until(lambda: bool(spans()), f"the span of {request_id} reached the collector")
    [span] = spans()
    return span


def check_span(span: ReceivedSpan, prompt_tokens: int, completion_tokens: int) -> None:
    attributes = span.attributes
    assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER
    assert attributes[SpanAttributes.GEN_AI_RESPONSE_MODEL] == "traced-hash"
    assert attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == prompt_tokens
    assert attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] == completion_tokens
    assert attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] == completion_tokens
    queue = attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE]
    ttft = attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN]
    assert queue >= 0 and 0 <= ttft <= attributes[SpanAttributes.GEN_AI_LATENCY_E2E]
    assert span.start_time_unix_nano <= span.end_time_unix_nano


def test_a_traceparent_header_makes_the_span_a_child_of_the_callers_span(
    server: RemoteServer, collector: OTLPCollector
) -> None:
    client = server.client()
    completion = client.completions.create(
        model="traced-hash",
        prompt=[5, 6, 7, 8],
        max_tokens=4,
        extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=value"},
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    span = span_of(collector, completion.id.removeprefix("cmpl-"))
    check_span(span, prompt_tokens=4, completion_tokens=4)
    assert span.trace_id == TRACE_ID and span.parent_span_id == PARENT_SPAN_ID


def test_a_streamed_request_joins_its_trace_too(
    server: RemoteServer, collector: OTLPCollector
) -> None:
    stream = server.client().completions.create(
        model="traced-hash",
        prompt=[1, 2, 3],
        max_tokens=3,
        stream=True,
        extra_headers={"traceparent": TRACEPARENT},
    )
    chunk_ids = {chunk.id for chunk in stream}
    [response_id] = chunk_ids
    span = span_of(collector, response_id.removeprefix("cmpl-"))
    check_span(span, prompt_tokens=3, completion_tokens=3)
    assert span.trace_id == TRACE_ID and span.parent_span_id == PARENT_SPAN_ID


def test_a_request_without_trace_context_starts_a_trace(
    server: RemoteServer, collector: OTLPCollector
) -> None:
    completion = server.client().completions.create(
        model="traced-hash", prompt=[9, 9, 9], max_tokens=2, extra_headers={"X-Request-Id": "plain"}
    )
    assert completion.id == "cmpl-plain"
    span = span_of(collector, "plain")
    check_span(span, prompt_tokens=3, completion_tokens=2)
    assert span.parent_span_id == 0 and span.trace_id not in (0, TRACE_ID)


def test_serving_goes_on_when_the_collector_goes_away(
    server: RemoteServer, collector: OTLPCollector
) -> None:
    """Last in this module: with the collector stopped, every export fails; requests are served as ever."""
    collector.stop()
    client = server.client()
    for _ in range(3):
        completion = client.completions.create(model="traced-hash", prompt=[1, 2], max_tokens=2)
        assert completion.usage is not None and completion.usage.completion_tokens == 2
    assert server.get("/health").status_code == 200
