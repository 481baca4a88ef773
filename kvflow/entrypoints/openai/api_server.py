"""The app behind `kvflow serve`: routes, middleware, error handlers, and the uvicorn server that runs it.

    GET  /health               200 while the engine runs, 503 once it has died
    GET  /version              {"version": kvflow's}
    GET  /metrics              Prometheus text (see metrics.py)
    GET  /v1/models            the served model's card
    POST /v1/completions       serving_completion.py
    POST /v1/chat/completions  serving_chat.py
    POST /v1/responses, GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel,
    GET /v1/responses/{id}/input_items  serving_responses.py
    POST /tokenize, /detokenize  serving_tokenization.py
  with --runner pooling (on a generate server these are a 400 naming the runner; on a pooling server the
  completions and chat endpoints are):
    POST /v1/embeddings, /pooling  serving_embedding.py
    POST /classify             serving_classification.py
    POST /v1/score, /score, /v1/rerank, /rerank, /v2/rerank  serving_score.py
    GET  /is_paused, and with --enable-admin-endpoints pause / resume and the admin endpoints: rl.py
  with --enable-runtime-lora-updating (404 without, as in vLLM), see serving_models.py:
    POST /v1/load_lora_adapter {"lora_name", "lora_path"[, "load_inplace"]}  200 text, 400 naming the problem
    POST /v1/unload_lora_adapter {"lora_name"} or {"lora_int_id"}           200 text, 404 unknown adapter

Adapters given with --lora-modules are loaded into the engine before the server serves (a bad one stops it with
its error); a request's `model` may name any registered adapter.

Every error is OpenAI's body (errors.py); an exception no route turned into a response is a 500 that keeps the
connection usable (middleware.py). With an API key, every path except /health, /metrics and /version needs
`Authorization: Bearer KEY` (401 otherwise). With --allowed-origins, browser pages from those origins may call
the server (CORS, middleware.py); without it, no CORS headers are sent. A request's `X-Request-Id` header is its
id and is echoed on the response. The socket is bound and listening before the engine starts
(`kvflow.entrypoints.cli.serve`); the address is announced once uvicorn serves it. SIGINT and SIGTERM stop the
server: requests in flight end (finish_reason "abort"), the engine shuts down, and the process exits with status 0.

As one of several API server processes (`kvflow serve --api-server-count N`, `api_servers.py`), the same app runs
with `api_server_index` set: every response carries `X-Kvflow-Api-Server: <index>` (which process answered), the
admin endpoints act on the shared engine cores (see `rl.RLControl`), the address is announced by the launcher once
every process serves, and shutting down detaches this process from the engine cores (the launcher stops them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING

import prometheus_client
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.engine.async_llm import EngineDeadError
from kvflow.entrypoints.openai.chat_prompt import ChatPromptRenderer
from kvflow.entrypoints.openai.errors import (
    OpenAIServingError,
    error_response,
    validation_message,
    validation_param,
)
from kvflow.entrypoints.openai.metrics import CONTENT_TYPE_LATEST
from kvflow.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    BodySurrogateScanMiddleware,
    RequestIdMiddleware,
    UnexpectedErrorMiddleware,
    cors_options,
)
from kvflow.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from kvflow.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from kvflow.entrypoints.openai.protocol_responses import ResponsesRequest
from kvflow.entrypoints.openai.response_store import ResponseStore
from kvflow.entrypoints.openai.rl import RLControl, admin_router, control_router
from kvflow.entrypoints.openai.server_config import ServerConfig
from kvflow.entrypoints.openai.serving_chat import OpenAIServingChat
from kvflow.entrypoints.openai.serving_classification import OpenAIServingClassification
from kvflow.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvflow.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from kvflow.entrypoints.openai.serving_engine import LiveRequests
from kvflow.entrypoints.openai.serving_models import OpenAIServingModels
from kvflow.entrypoints.openai.serving_pooling import engine_runner, require_runner
from kvflow.entrypoints.openai.serving_responses import OpenAIServingResponses
from kvflow.entrypoints.openai.serving_score import OpenAIServingScores
from kvflow.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvflow.entrypoints.openai.template_sandbox import TemplateSandbox
from kvflow.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvflow.entrypoints.openai.unsupported import UnknownFields
from kvflow.reasoning import REASONING_PARSERS
from kvflow.tracing import trace_server_requests
from kvflow.version import __version__

if TYPE_CHECKING:
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.entrypoints.openai.metrics import PrometheusStatLogger
    from kvflow.entrypoints.openai.tool_parsers import ToolParser
    from kvflow.reasoning import ReasoningParser

logger = logging.getLogger(__name__)

# Paths an API key does not guard: probes and scrapers.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
# After SIGINT/SIGTERM requests in flight are aborted at once; this bounds the wait for their responses to drain.
GRACEFUL_SHUTDOWN_S = 10.0
# The response header naming the API server process that answered (several API server processes only).
API_SERVER_HEADER = "X-Kvflow-Api-Server"


# ---------------------------------------------------------------------------------------------------- routes
router = APIRouter()


@router.get("/health")
async def health(raw_request: Request) -> Response:
    engine: AsyncLLM = raw_request.app.state.engine
    return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE if engine.errored else HTTPStatus.OK)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    """The metrics, with the gauges refreshed from the scheduler now: requests aborted since the last engine step
    (a client that went away) change them without any output that would report it."""
    state = raw_request.app.state
    stat_logger: PrometheusStatLogger = state.metrics
    token = stat_logger.refresh_token()
    with contextlib.suppress(EngineDeadError):
        stat_logger.refresh(await state.engine.scheduler_stats(), token)
    if state.engine.errored:
        stat_logger.mark_engine_dead()
    return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def show_models(raw_request: Request) -> ModelList:
    return raw_request.app.state.serving_models.model_list()


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    require_runner(raw_request.app.state.runner, "generate", raw_request.url.path)
    serving: OpenAIServingCompletion = raw_request.app.state.serving_completion
    return await serving.create_completion(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    require_runner(raw_request.app.state.runner, "generate", raw_request.url.path)
    serving: OpenAIServingChat = raw_request.app.state.serving_chat
    return await serving.create_chat_completion(request, raw_request)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    require_runner(raw_request.app.state.runner, "generate", raw_request.url.path)
    serving: OpenAIServingResponses = raw_request.app.state.serving_responses
    return await serving.create_response(request, raw_request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request) -> JSONResponse:
    serving: OpenAIServingResponses = raw_request.app.state.serving_responses
    return JSONResponse(serving.retrieve(response_id))


@router.get("/v1/responses/{response_id}/input_items")
async def list_response_input_items(response_id: str, raw_request: Request) -> JSONResponse:
    serving: OpenAIServingResponses = raw_request.app.state.serving_responses
    return JSONResponse(serving.input_items(response_id, raw_request.query_params))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request) -> JSONResponse:
    serving: OpenAIServingResponses = raw_request.app.state.serving_responses
    return JSONResponse(await serving.delete(response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, raw_request: Request) -> JSONResponse:
    serving: OpenAIServingResponses = raw_request.app.state.serving_responses
    return JSONResponse(await serving.cancel(response_id))


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> TokenizeResponse:
    return await raw_request.app.state.serving_tokenization.tokenize(request)


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    return raw_request.app.state.serving_tokenization.detokenize(request)


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    serving: OpenAIServingEmbedding = raw_request.app.state.serving_embedding
    return await serving.create_embedding(request, raw_request)


@router.post("/pooling")
async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
    serving: OpenAIServingEmbedding = raw_request.app.state.serving_embedding
    return await serving.create_pooling(request, raw_request)


@router.post("/classify")
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    serving: OpenAIServingClassification = raw_request.app.state.serving_classification
    return await serving.create_classify(request, raw_request)


@router.post("/v1/score")
@router.post("/score")
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    serving: OpenAIServingScores = raw_request.app.state.serving_scores
    return await serving.create_score(request, raw_request)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
    serving: OpenAIServingScores = raw_request.app.state.serving_scores
    return await serving.create_rerank(request, raw_request)


# Mounted with --enable-runtime-lora-updating only (vLLM mounts them only under VLLM_ALLOW_RUNTIME_LORA_UPDATING).
lora_router = APIRouter()


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    request: LoadLoRAAdapterRequest, raw_request: Request
) -> PlainTextResponse:
    models: OpenAIServingModels = raw_request.app.state.serving_models
    raw_request.app.state.unknown_fields.report(request.model_extra)
    await models.load_lora_adapter(request.lora_name, request.lora_path, request.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    request: UnloadLoRAAdapterRequest, raw_request: Request
) -> PlainTextResponse:
    models: OpenAIServingModels = raw_request.app.state.serving_models
    raw_request.app.state.unknown_fields.report(request.model_extra)
    removed = await models.unload_lora_adapter(request.lora_name, request.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{removed.lora_name}' removed successfully.")


# ---------------------------------------------------------------------------------------------------- app
def _tool_parser(config: ServerConfig, engine: AsyncLLM) -> ToolParser | None:
    """`--tool-call-parser`'s parser over the engine's tokenizer (None without the flag)."""
    if config.tool_call_parser is None:
        return None
    return TOOL_PARSERS.get(config.tool_call_parser)(engine.get_tokenizer())


def _reasoning_parser(engine: AsyncLLM) -> ReasoningParser | None:
    """`--reasoning-parser` (an engine option: the engine core needs it too, to start constraints after
    reasoning ends)."""
    name = engine.engine_config.structured_outputs_config.reasoning_parser
    return None if name is None else REASONING_PARSERS.get(name)()


def build_app(
    engine: AsyncLLM,
    config: ServerConfig,
    stat_logger: PrometheusStatLogger,
    api_server_index: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (which must be the engine `stat_logger` is registered with).
    `api_server_index`: this process's index among several API server processes (None: the only one)."""
    if config.enable_runtime_lora_updating and api_server_index is not None:
        # `kvflow serve` refuses this at startup; checked here too for direct callers.
        raise ValueError(
            "--enable-runtime-lora-updating needs a single API server process: each process keeps its own "
            "adapter names (drop --api-server-count, or register adapters with --lora-modules)"
        )
    models = OpenAIServingModels(engine, config.served_model_name, config.lora_modules)
    template_sandbox = TemplateSandbox() if config.trust_request_chat_template else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            try:
                await models.load_static_loras()
            except ValueError as error:  # `run_server` raises it once uvicorn has given up starting
                app.state.startup_error = error
                raise
            yield
        finally:
            if template_sandbox is not None:
                template_sandbox.close()

    app = FastAPI(title="kvflow", version=__version__, lifespan=lifespan)
    live_requests = LiveRequests()
    chat_prompt = ChatPromptRenderer(engine.get_tokenizer(), config.chat_template, template_sandbox)
    unknown_fields = UnknownFields()
    serving = (engine, models, live_requests, config.limits, unknown_fields)
    app.state.startup_error = None
    app.state.unknown_fields = unknown_fields
    app.state.engine = engine
    app.state.metrics = stat_logger
    app.state.serving_models = models
    app.state.serving_completion = OpenAIServingCompletion(*serving)
    app.state.serving_chat = OpenAIServingChat(
        *serving,
        chat_prompt=chat_prompt,
        tool_parser=_tool_parser(config, engine),
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        reasoning_parser=_reasoning_parser(engine),
    )
    app.state.serving_responses = OpenAIServingResponses(
        *serving,
        chat_prompt=chat_prompt,
        tool_parser=_tool_parser(config, engine),
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        reasoning_parser=_reasoning_parser(engine),
        store=ResponseStore(config.max_stored_responses),
    )
    app.state.serving_tokenization = OpenAIServingTokenization(engine, models, chat_prompt)
    app.state.runner = engine_runner(engine)
    app.state.serving_embedding = OpenAIServingEmbedding(*serving, chat_prompt=chat_prompt)
    app.state.serving_classification = OpenAIServingClassification(*serving)
    app.state.serving_scores = OpenAIServingScores(*serving)
    app.state.rl_control = RLControl(
        engine, live_requests, shared_engine=api_server_index is not None
    )
    trace_server_requests(app, engine, config.served_model_name)  # with --otlp-traces-endpoint
    app.include_router(router)
    app.include_router(control_router)
    if config.enable_admin_endpoints:
        app.include_router(admin_router)
    if config.enable_runtime_lora_updating:
        logger.warning(
            "runtime LoRA updating is on: POST /v1/load_lora_adapter loads any adapter folder this process "
            "can read%s",
            "" if config.api_key else " (and the server has no --api-key)",
        )
        app.include_router(lora_router)
    _add_error_handlers(app)
    # Added innermost first: requests pass RequestId, CORS (with --allowed-origins: preflights are answered there,
    # before the API key is asked for), UnexpectedError, BodySizeLimit, APIKey, BodySurrogateScan, then the routes.
    app.add_middleware(BodySurrogateScanMiddleware)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key, open_paths=OPEN_PATHS)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.limits.max_request_body_bytes)
    app.add_middleware(UnexpectedErrorMiddleware)
    if config.cors is not None:
        app.add_middleware(CORSMiddleware, **cors_options(config.cors))
    app.add_middleware(RequestIdMiddleware)
    if api_server_index is not None:
        app.add_middleware(ApiServerHeaderMiddleware, index=api_server_index)
    return app


class ApiServerHeaderMiddleware:
    """Adds `X-Kvflow-Api-Server: <index>` to every HTTP response (plain ASGI: streams pass through untouched)."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app = app
        self.header = (API_SERVER_HEADER.lower().encode(), str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's body."""

    @app.exception_handler(OpenAIServingError)
    async def serving_error(_: Request, error: OpenAIServingError) -> JSONResponse:
        return error_response(error.status_code, error.message, error.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        errors = list(error.errors())
        return error_response(
            HTTPStatus.BAD_REQUEST, validation_message(errors), validation_param(errors)
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, f"the engine is not running: {error}")

    @app.exception_handler(ValueError)
    async def value_error(_: Request, error: ValueError) -> JSONResponse:
        return error_response(HTTPStatus.BAD_REQUEST, str(error))

    # Any other exception: UnexpectedErrorMiddleware (a handler for `Exception` here would re-raise after
    # answering, and uvicorn would then close the connection under the client).


# ---------------------------------------------------------------------------------------------------- serving
class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGINT/SIGTERM end it with exit status 0 (uvicorn re-raises the signal once
    it has stopped) and that shutting down first shuts the engine down, so requests in flight end at once
    (finish_reason "abort") instead of holding the shutdown until they finish."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncLLM,
        server_config: ServerConfig,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.server_config = server_config
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start serving, then say so: the address is announced only once the socket accepts connections (with
        `on_started`, that is its business: one of several API server processes)."""
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()
        elif self.started:
            logger.info(
                "kvflow serve: model %r at http://%s (OpenAI API under /v1)",
                self.server_config.served_model_name,
                _display_address(self.server_config.host, self.server_config.port),
            )

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: ending the requests in flight")
        await asyncio.to_thread(self.engine.shutdown)
        await super().shutdown(sockets)


def run_server(
    engine: AsyncLLM,
    config: ServerConfig,
    stat_logger: PrometheusStatLogger,
    sock: socket.socket,
    api_server_index: int | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Serve on `sock` (bound and listening) until SIGINT/SIGTERM; returns once the engine has shut down and every
    response has ended. RuntimeError if the server could not start. `api_server_index`: see `build_app`;
    `on_started` is called once the socket is served (instead of announcing the address)."""
    _route_uvicorn_logs()
    raise_open_files_limit()
    # No `*_created` series next to every counter and histogram, as in vLLM (a process-wide prometheus_client
    # setting, fine in the server's own process).
    prometheus_client.disable_created_metrics()
    config = dataclasses.replace(config, port=sock.getsockname()[1])
    app = build_app(engine, config, stat_logger, api_server_index)
    uvicorn_config = uvicorn.Config(
        app,
        log_config=None,
        log_level=config.uvicorn_log_level,
        access_log=True,  # shown only at --uvicorn-log-level info or debug
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=config.timeout_keep_alive_s,
    )
    server = _Server(uvicorn_config, engine, config, on_started)
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit when the app's startup failed
        if app.state.startup_error is not None:
            raise app.state.startup_error from None
        raise
    if not server.started:
        raise RuntimeError("the HTTP server did not start (its error is logged above)")
    logger.info("kvflow serve stopped")


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one (as vLLM does): every kept-alive connection holds one,
    and the default soft limit (often 1024) is below what a busy server keeps open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _display_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _route_uvicorn_logs() -> None:
    """uvicorn's records go through kvflow's log handler (same format, stderr); their level is uvicorn's own."""
    uvicorn_logger = logging.getLogger("uvicorn")
    for handler in logging.getLogger("kvflow").handlers:
        if handler not in uvicorn_logger.handlers:
            uvicorn_logger.addHandler(handler)
