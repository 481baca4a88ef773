"""OpenTelemetry traces of requests (`otlp_traces_endpoint=`, `kvflow serve --otlp-traces-endpoint URL`), as vLLM
emits them.

Every core request that finishes becomes one span named `llm_request` (kind SERVER) running from the request's
arrival to its finish, with vLLM's attribute names (`SpanAttributes`): the request id the user gave (a
parallel-sampling request's `n` samples each end a span of their own, under the one id, as in vLLM), the model, the
sampling parameters, the token counts and the latencies the front end measures (`FinishedRequestStats`). A request
that carried W3C trace context (`traceparent` / `tracestate`: HTTP headers to the server, `trace_headers=` to
`AsyncLLM.generate`) gets a span in that trace, as a child of the caller's span.

OpenTelemetry is the optional extra `kvflow[otel]` (opentelemetry-sdk and opentelemetry-exporter-otlp). This module
itself imports only the standard library: OpenTelemetry loads when a tracer is built, so an engine without an
endpoint never imports it. Spans leave through a `BatchSpanProcessor` (a background thread, every
`$OTEL_BSP_SCHEDULE_DELAY` ms, 5000 by default, and at exit); a collector that is down or refuses them costs the
engine nothing but the SDK's warnings in the log.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from opentelemetry.sdk.trace.export import SpanExporter
    from starlette.types import ASGIApp, Receive, Scope, Send

    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.engine.output_processor import RequestState
    from kvflow.engine.stats import FinishedRequestStats
    from kvflow.entrypoints.llm import LLM

logger = logging.getLogger(__name__)

# The W3C trace-context headers a request may carry (lower case, as ASGI spells header names).
TRACE_HEADERS = ("traceparent", "tracestate")
_TRACE_HEADER_NAMES = tuple(name.encode("latin-1") for name in TRACE_HEADERS)
INSTALL_HINT = "pip install 'kvflow[otel]'"
SPAN_NAME = "llm_request"
INSTRUMENTATION_NAME = "kvflow.tracing"
# OpenTelemetry's variable for the OTLP protocol of traces; vLLM reads it too ("grpc" unless set).
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
# The exporter module of each OTLP protocol.
_EXPORTER_MODULES = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}


class SpanAttributes:
    """The span attribute names, vLLM's (OpenTelemetry's gen-ai conventions where they have one)."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


# ------------------------------------------------------------------------------------------------ setup
def otlp_protocol(environ: Mapping[str, str] = os.environ) -> str:
    """The OTLP protocol spans are sent with: `$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, "grpc" by default, or
    "http/protobuf"; another value is a ValueError naming the variable."""
    protocol = environ.get(PROTOCOL_ENV, "").strip() or "grpc"
    if protocol not in _EXPORTER_MODULES:
        raise ValueError(
            f"{PROTOCOL_ENV}={protocol!r} is not an OTLP protocol kvflow exports traces with: "
            f"use one of {tuple(_EXPORTER_MODULES)}"
        )
    return protocol


def check_otel_available(option: str = "otlp_traces_endpoint") -> None:
    """ValueError naming `option` and the extra to install unless OpenTelemetry's SDK and the OTLP exporter of
    the configured protocol import."""
    for module in ("opentelemetry.sdk.trace", _EXPORTER_MODULES[otlp_protocol()]):
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(
                f"{option} needs OpenTelemetry, which is not installed ({error}): {INSTALL_HINT}"
            ) from error


def otlp_span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter of the configured protocol (`otlp_protocol`) sending to `endpoint` (gRPC:
    `http://host:4317`, plain text for http://; HTTP: `http://host:4318/v1/traces`). The rest of its settings
    (headers, timeout, certificates) come from OpenTelemetry's `OTEL_EXPORTER_OTLP_*` variables."""
    module = importlib.import_module(_EXPORTER_MODULES[otlp_protocol()])
    exporter: SpanExporter = module.OTLPSpanExporter(endpoint=endpoint)
    return exporter


def build_request_tracer(endpoint: str | None, model_name: str) -> RequestTracer | None:
    """The tracer of an engine with `otlp_traces_endpoint=endpoint` (None: no tracing, and no import);
    `model_name` is the model as the engine was given it ("default" for the built-in one)."""
    if endpoint is None:
        return None
    return RequestTracer(otlp_span_exporter(endpoint), model_name)


def trace_requests(
    engine: LLM | AsyncLLM, span_exporter: SpanExporter, batch: bool = False
) -> RequestTracer:
    """Trace `engine`'s requests (an `LLM` or `AsyncLLM`) to `span_exporter` from now on, instead of the exporter
    its `otlp_traces_endpoint` built (which is shut down). `batch=False` hands each span to the exporter as it ends,
    on the engine's output thread (for exporters that return at once: tests read an `InMemorySpanExporter` right
    after a request); True batches them on a thread of their own, as the OTLP path does."""
    output_processor = engine.output_processor
    previous: RequestTracer | None = output_processor.tracer
    model_name = previous.model_name if previous is not None else engine.model_info.name
    output_processor.tracer = tracer = RequestTracer(span_exporter, model_name, batch=batch)
    if previous is not None:
        previous.shutdown()
    return tracer


# ------------------------------------------------------------------------------------------------ spans
class RequestTracer:
    """Ends one span per finished core request (`request_finished`, called by the output processor).

    Invariants: `request_finished` never raises (a failure is logged and the span dropped), so tracing cannot break
    a request; spans go through this tracer's own `TracerProvider` (the process's global one is left alone);
    `model_name` is `gen_ai.response.model` for requests without a LoRA adapter (the server sets its
    `--served-model-name`), an adapter's name otherwise.
    """

    def __init__(self, span_exporter: SpanExporter, model_name: str, batch: bool = True) -> None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.model_name = model_name
        self.span_exporter = span_exporter
        self._provider = TracerProvider()
        processor = BatchSpanProcessor if batch else SimpleSpanProcessor
        self._provider.add_span_processor(processor(span_exporter))
        self._tracer = self._provider.get_tracer(INSTRUMENTATION_NAME)
        self._propagator = TraceContextTextMapPropagator()
        self._span_kind = SpanKind.SERVER

    def request_finished(self, state: RequestState, stats: FinishedRequestStats) -> None:
        """End the span of `state`'s request, which just finished with `stats`."""
        try:
            context = self._propagator.extract(state.trace_headers) if state.trace_headers else None
            finished_time = state.metrics.finished_time
            span = self._tracer.start_span(
                SPAN_NAME,
                context=context,
                kind=self._span_kind,
                attributes=self.attributes(state, stats),
                start_time=_nanoseconds(state.metrics.arrival_time),
            )
            span.end(end_time=_nanoseconds(finished_time) if finished_time is not None else None)
        except Exception:
            logger.warning("could not trace request %r", state.request_id, exc_info=True)

    def attributes(self, state: RequestState, stats: FinishedRequestStats) -> dict[str, Any]:
        """The span attributes of a finished request; a latency is left out when one of its ends never happened
        (no token came out, or the request was never scheduled)."""
        parent = state.parent
        lora = state.lora_request
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: parent.request_id if parent else state.request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: lora.lora_name if lora else self.model_name,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: stats.num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: stats.num_generation_tokens,
            SpanAttributes.GEN_AI_LATENCY_E2E: stats.e2e_latency,
        }
        if stats.finish_reason is not None:
            attributes[SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS] = (stats.finish_reason,)
        latencies = {
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: stats.queue_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: stats.time_to_first_token,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: stats.prefill_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: stats.decode_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: stats.inference_time,
        }
        attributes.update({name: value for name, value in latencies.items() if value is not None})
        if not state.is_pooling:  # a pooling request samples nothing
            params = state.sampling_params
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
            attributes[SpanAttributes.GEN_AI_REQUEST_TEMPERATURE] = params.temperature
            attributes[SpanAttributes.GEN_AI_REQUEST_TOP_P] = params.top_p
            attributes[SpanAttributes.GEN_AI_REQUEST_N] = parent.n if parent else params.n
        return attributes

    def shutdown(self) -> None:
        """Export what is pending and stop the export thread (the provider also does this at exit)."""
        self._provider.shutdown()


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


# ------------------------------------------------------------------------------------------------ server side
# The trace context of the HTTP request being served (`TraceHeadersMiddleware`); None outside one, or without it.
_REQUEST_TRACE_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "kvflow_request_trace_headers", default=None
)


def current_trace_headers() -> dict[str, str] | None:
    """The trace-context headers of the HTTP request this task serves (set by `TraceHeadersMiddleware`)."""
    return _REQUEST_TRACE_HEADERS.get()


class TraceHeadersMiddleware:
    """ASGI middleware: keeps an HTTP request's `traceparent` / `tracestate` headers in a context variable while
    the request is served (its streamed body included), where the serving code reads them
    (`current_trace_headers`) to hand them to the engine. Only installed when the engine traces."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _TRACE_HEADER_NAMES
        }
        token = _REQUEST_TRACE_HEADERS.set(headers or None)
        try:
            await self.app(scope, receive, send)
        finally:
            _REQUEST_TRACE_HEADERS.reset(token)


def trace_server_requests(app: FastAPI, engine: AsyncLLM, served_model_name: str) -> None:
    """Wire the server to its engine's tracer, if it has one (`--otlp-traces-endpoint`): spans name the served
    model, and requests hand their HTTP trace context to the engine (`TraceHeadersMiddleware`)."""
    tracer = engine.output_processor.tracer
    if tracer is None:
        return
    tracer.model_name = served_model_name
    app.add_middleware(TraceHeadersMiddleware)
