"""OpenTelemetry tracing (`otlp_traces_endpoint`, kvflow.tracing): one `llm_request` span per finished request with
vLLM's attribute names, joined to the caller's trace, exported over OTLP to a real collector, and never in the way
of a request (a dead collector, a failing exporter, no OpenTelemetry installed)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvflow import LLM, AsyncLLM, RequestOutput, SamplingParams
from kvflow.engine.arg_utils import EngineArgs
from kvflow.testing.waiting import wait_until
from kvflow.tracing import SpanAttributes, otlp_span_exporter, trace_requests
from tests.otel_collector import running_collector

OPTIONS = dict(max_model_len=64, num_kv_blocks=32, block_size=4)
PROMPTS = [{"prompt_token_ids": [3, 1, 4, 1, 5]}, {"prompt_token_ids": [2, 7, 1, 8]}]
# W3C trace context as a caller's tracer sends it: version, trace id, parent span id, flags (sampled).
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"

REQUEST_ATTRIBUTES = {
    SpanAttributes.GEN_AI_REQUEST_ID,
    SpanAttributes.GEN_AI_RESPONSE_MODEL,
    SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS,
    SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS,
    SpanAttributes.GEN_AI_REQUEST_TEMPERATURE,
    SpanAttributes.GEN_AI_REQUEST_TOP_P,
    SpanAttributes.GEN_AI_REQUEST_N,
    SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS,
    SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS,
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE,
    SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
    SpanAttributes.GEN_AI_LATENCY_E2E,
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE,
}


def test_vllms_attribute_names() -> None:
    assert {
        "gen_ai.request.id",
        "gen_ai.response.model",
        "gen_ai.request.max_tokens",
        "gen_ai.request.temperature",
        "gen_ai.request.top_p",
        "gen_ai.request.n",
        "gen_ai.usage.prompt_tokens",
        "gen_ai.usage.completion_tokens",
        "gen_ai.latency.time_in_queue",
        "gen_ai.latency.time_to_first_token",
        "gen_ai.latency.e2e",
        "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode",
        "gen_ai.latency.time_in_model_inference",
    } < REQUEST_ATTRIBUTES


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM("hash", **OPTIONS)
    yield engine
    engine.output_processor.tracer.shutdown()  # type: ignore[union-attr]


def check_span(span: ReadableSpan, output: RequestOutput, params: SamplingParams) -> None:
    """`span` is the span of one sample of `output`, whose request ran with `params`."""
    attributes = dict(span.attributes or {})
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    assert set(attributes) == REQUEST_ATTRIBUTES
    completions = {len(c.token_ids): c for c in output.outputs}
    completion = completions[attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS]]
    assert attributes[SpanAttributes.GEN_AI_REQUEST_ID] == output.request_id
    assert attributes[SpanAttributes.GEN_AI_RESPONSE_MODEL] == "hash"
    assert attributes[SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS] == (completion.finish_reason,)
    assert attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == len(output.prompt_token_ids)
    assert attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] == params.max_tokens
    assert attributes[SpanAttributes.GEN_AI_REQUEST_TEMPERATURE] == params.temperature
    assert attributes[SpanAttributes.GEN_AI_REQUEST_TOP_P] == pytest.approx(params.top_p)
    assert attributes[SpanAttributes.GEN_AI_REQUEST_N] == params.n
    queue = attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE]
    ttft = attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN]
    e2e = attributes[SpanAttributes.GEN_AI_LATENCY_E2E]
    prefill = attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL]
    decode = attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE]
    inference = attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE]
    assert queue >= 0 and prefill >= 0 and decode >= 0
    assert 0 <= ttft <= e2e and queue + inference <= e2e + 1e-6
    assert inference == pytest.approx(prefill + decode)
    # The span runs from the request's arrival to its finish (the same clock as RequestOutput.metrics).
    assert span.start_time is not None and span.end_time is not None
    assert output.metrics is not None
    assert span.start_time == pytest.approx(output.metrics.arrival_time * 1e9, abs=1e3)
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(e2e, abs=1e-6)


def test_llm_ends_one_span_per_request_with_vllms_attributes(llm: LLM) -> None:
    exporter = InMemorySpanExporter()
    trace_requests(llm, exporter)
    params = [
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=1),
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    by_id = {span.attributes[SpanAttributes.GEN_AI_REQUEST_ID]: span for span in spans}  # type: ignore[index]
    for output, request_params in zip(outputs, params, strict=True):
        check_span(by_id[output.request_id], output, request_params)
        assert by_id[output.request_id].parent is None  # no trace context given: a trace of its own


def test_parallel_samples_each_end_a_span_under_the_request_id(llm: LLM) -> None:
    exporter = InMemorySpanExporter()
    trace_requests(llm, exporter)
    params = SamplingParams(n=3, max_tokens=4, seed=5)
    [output] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    spans = exporter.get_finished_spans()
    assert len(spans) == 3  # one per sample, under the one request id (vLLM's spans too)
    for span in spans:
        check_span(span, output, params)
    counts = sorted(s.attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] for s in spans)  # type: ignore[index]
    assert counts == sorted(len(completion.token_ids) for completion in output.outputs)


class FailingExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: object) -> SpanExportResult:
        self.calls += 1
        raise ConnectionError("the collector is gone")


def test_an_exporter_that_fails_breaks_no_request(llm: LLM) -> None:
    exporter = FailingExporter()
    trace_requests(llm, exporter)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert [len(output.outputs[0].token_ids) for output in outputs] == [4, 4]
    assert exporter.calls == 2


def test_async_llm_spans_join_the_trace_context_they_are_given() -> None:
    async def run() -> tuple[list[RequestOutput], tuple[ReadableSpan, ...]]:
        engine = AsyncLLM("hash", **OPTIONS)
        exporter = InMemorySpanExporter()
        trace_requests(engine, exporter)
        params = SamplingParams(max_tokens=5)
        try:
            headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=value"}
            traced = [
                out
                async for out in engine.generate(
                    PROMPTS[0], params, "traced", trace_headers=headers
                )
            ]
            untraced = [out async for out in engine.generate(PROMPTS[1], params, "untraced")]
        finally:
            engine.shutdown()
        return [traced[-1], untraced[-1]], exporter.get_finished_spans()

    outputs, spans = asyncio.run(run())
    by_id = {span.attributes[SpanAttributes.GEN_AI_REQUEST_ID]: span for span in spans}  # type: ignore[index]
    assert set(by_id) == {"traced", "untraced"}
    for output in outputs:
        check_span(by_id[output.request_id], output, SamplingParams(max_tokens=5))
    traced = by_id["traced"]
    assert traced.context is not None and traced.parent is not None
    assert traced.context.trace_id == TRACE_ID and traced.parent.span_id == PARENT_SPAN_ID
    assert traced.parent.is_remote and dict(traced.context.trace_state) == {"vendor": "value"}
    untraced = by_id["untraced"]
    assert untraced.parent is None and untraced.context.trace_id != TRACE_ID  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ OTLP
def test_the_endpoint_exports_over_otlp_to_a_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")  # ms between batches (default 5000)
    with running_collector() as collector:
        llm = LLM("hash", otlp_traces_endpoint=collector.endpoint, **OPTIONS)
        tracer = llm.output_processor.tracer
        assert isinstance(tracer.span_exporter, GrpcExporter)  # type: ignore[union-attr]
        try:
            [output] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)
            wait_until(lambda: collector.spans, "the collector received the span")
        finally:
            tracer.shutdown()  # type: ignore[union-attr]
    [span] = collector.spans
    assert span.name == "llm_request" and span.parent_span_id == 0
    assert span.attributes[SpanAttributes.GEN_AI_REQUEST_ID] == output.request_id
    assert set(span.attributes) == REQUEST_ATTRIBUTES
    assert span.attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] == 3


def free_port() -> int:
    """A port nothing listens on (bound for a moment, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("protocol", "exporter_type", "path"),
    [("grpc", GrpcExporter, ""), ("http/protobuf", HttpExporter, "/v1/traces")],
)
def test_a_collector_that_is_down_breaks_no_request(
    monkeypatch: pytest.MonkeyPatch, protocol: str, exporter_type: type, path: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TIMEOUT", "1"
    )  # s: the SDK gives up on the dead collector soon
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    endpoint = f"http://127.0.0.1:{free_port()}{path}"
    assert isinstance(otlp_span_exporter(endpoint), exporter_type)
    llm = LLM("hash", otlp_traces_endpoint=endpoint, **OPTIONS)
    tracer = llm.output_processor.tracer
    assert isinstance(tracer.span_exporter, exporter_type)  # type: ignore[union-attr]
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=3), use_tqdm=False)
        assert [len(output.outputs[0].token_ids) for output in outputs] == [3, 3]
    finally:
        tracer.shutdown()  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ setup errors
def test_without_opentelemetry_the_endpoint_is_an_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(
        ValueError, match=r"otlp_traces_endpoint needs OpenTelemetry.*kvflow\[otel\]"
    ):
        EngineArgs(model="hash", otlp_traces_endpoint="http://127.0.0.1:4317")
    EngineArgs(model="hash")  # no endpoint: nothing to import


def test_an_unknown_otlp_protocol_is_an_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        EngineArgs(model="hash", otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")


def test_an_engine_without_an_endpoint_never_imports_opentelemetry() -> None:
    script = (
        "import sys\n"
        "from kvflow import LLM, SamplingParams\n"
        f"llm = LLM('hash', **{OPTIONS!r})\n"
        "llm.generate([{'prompt_token_ids': [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print(sorted(name for name in sys.modules if name.startswith('opentelemetry')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"
