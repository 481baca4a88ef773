"""The server's ASGI middleware, outermost first: request ids, CORS, unexpected errors, body size, API key.

    RequestIdMiddleware         echoes `X-Request-Id` on the response (errors included)
    CORSMiddleware              Starlette's, with --allowed-origins only (`cors_options`): answers browser
                                preflights itself, before the API key is asked for (a preflight never carries
                                one), and adds the CORS headers to every answer, 401, 413 and 500 included, so
                                a page can read why its call failed
    UnexpectedErrorMiddleware   any exception a route did not turn into a response: logged once with the request id
                                and traceback, answered with a 500 in OpenAI's shape on a connection that stays usable
    BodySizeLimitMiddleware     a body over `--max-request-body-bytes`: 413 before the route reads it
    APIKeyMiddleware            `Authorization: Bearer <key>` on every path but the open ones (401)
    BodySurrogateScanMiddleware scans the body as the route reads it, so that validation checks its text for lone
                                surrogates only when the body can hold one (`protocol.BodySurrogateScan`)

Why the error middleware: Starlette's own handler for `Exception` answers and then re-raises, so uvicorn closes
the connection after the 500 without saying `Connection: close`, and a client that pools connections fails its
next request on it. Here the exception stops: uvicorn keeps the connection alive, as after any other response.
"""

from __future__ import annotations

import logging
import secrets
from http import HTTPStatus
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException

from kvflow.entrypoints.openai.errors import error_response
from kvflow.entrypoints.openai.protocol import BODY_SURROGATE_SCAN, BodySurrogateScan

if TYPE_CHECKING:
    from collections.abc import Collection

    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from kvflow.entrypoints.openai.server_config import CORSConfig

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


class RequestIdMiddleware:
    """Echoes a request's `X-Request-Id` header on its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = (
            Headers(scope=scope).get(REQUEST_ID_HEADER) if scope["type"] == "http" else None
        )
        if not request_id:
            await self.app(scope, receive, send)
            return

        async def send_with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message.setdefault("headers", []))[REQUEST_ID_HEADER] = (
                    request_id
                )
            await send(message)

        await self.app(scope, receive, send_with_request_id)


def cors_options(cors: CORSConfig) -> dict[str, object]:
    """Starlette's `CORSMiddleware` arguments for `cors`. Its behaviour, relied on: a preflight (OPTIONS with
    Origin and Access-Control-Request-Method) is answered 200 with the allowed origin, methods and headers, or
    400 naming what is disallowed, without reaching the routes; an answer to an origin not allowed has no
    Access-Control-Allow-Origin; with credentials, '*' origins answer with the request's own Origin (and '*'
    methods and headers with the list or the requested ones), as browsers require."""
    if cors.any_origin_with_credentials:
        logger.warning(
            "CORS: --allow-credentials with '*' origins lets any web site call this server with its users' "
            "cookies and HTTP authentication; name the origins in --allowed-origins to narrow it"
        )
    return {
        "allow_origins": cors.allowed_origins,
        "allow_methods": cors.allowed_methods,
        "allow_headers": cors.allowed_headers,
        "allow_credentials": cors.allow_credentials,
    }


class UnexpectedErrorMiddleware:
    """Turns an exception no route handled into a 500 in OpenAI's shape, logged once with the request's id and
    traceback. The connection stays usable. An exception after the response started cannot be answered: it is
    logged, and the connection is closed (re-raised to uvicorn), the only honest end of a half-sent response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            request_id = Headers(scope=scope).get(REQUEST_ID_HEADER, "-")
            logger.error(
                "unexpected error in %s %s (request id %s)",
                scope.get("method"),
                scope.get("path"),
                request_id,
                exc_info=error,
            )
            if response_started:
                raise
            response = error_response(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                f"internal server error ({type(error).__name__}); the server log has the details",
            )
            await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body of more than `max_bytes`: at once when its Content-Length says so, or as soon as a
    body sent without one grows past it while the route reads it (an HTTPException there, answered by the app's
    handler). The rest of the body is read and dropped by the HTTP server (never stored), so the client can finish
    sending, read the 413, and go on using the connection."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.message = (
            f"the request body is larger than this server takes ({max_bytes} bytes, "
            "--max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self.message)
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self.message)
            return message

        await self.app(scope, counting_receive, send)


class APIKeyMiddleware:
    """401 for a request without `Authorization: Bearer <api key>`, except on `open_paths` (and CORS preflights)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Collection[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"] not in self.open_paths
        ):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    HTTPStatus.UNAUTHORIZED,
                    "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySurrogateScanMiddleware:
    """Feeds each body chunk the route reads to a `BodySurrogateScan` that the request's validation finds in
    `BODY_SURROGATE_SCAN` (a context variable: set here, read in the same request's task)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scan = BodySurrogateScan()

        async def scanning_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                scan.feed(message.get("body", b""))
            return message

        token = BODY_SURROGATE_SCAN.set(scan)
        try:
            await self.app(scope, scanning_receive, send)
        finally:
            BODY_SURROGATE_SCAN.reset(token)
