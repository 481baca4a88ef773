"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and where they come from.

Every error the server answers goes through `error_response`: the status code is also `code`, `type` is the name of
the exception class the official `openai` client raises for that status (`BadRequestError`, `NotFoundError`, ...),
and `param` names the request field at fault when there is one. kvflow's own ValueErrors start with the name of the
field they are about (`SamplingParams.top_p must be ...`, `prompt has 900 tokens ...`, `priority=3 needs ...`), so
`param_of` recovers the field from the message.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from http import HTTPStatus

from fastapi.responses import JSONResponse

from kvflow.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

# The openai client's exception class for each status.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
# `SamplingParams.max_tokens ...` or `prompt has ...`: the leading name of a kvflow ValueError.
_LEADING_NAME = re.compile(r"(?:SamplingParams\.)?([A-Za-z_][A-Za-z0-9_]*)")


class OpenAIServingError(Exception):
    """A request the server refuses: answered with `status_code` and OpenAI's error body.

    Invariant: `message` is what the client reads, so it says what to change; `param` is a request field or None.
    """

    def __init__(
        self, message: str, *, status_code: int = HTTPStatus.BAD_REQUEST, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param


def error_body(status_code: int, message: str, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status_code, HTTPStatus(status_code).phrase.replace(" ", ""))
    return ErrorResponse(
        error=ErrorInfo(message=message, type=error_type, param=param, code=status_code)
    )


def error_response(
    status_code: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status_code, message, param).model_dump(),
        status_code=status_code,
        headers=dict(headers) if headers else None,
    )


def param_of(
    error: BaseException, fields: Collection[str], aliases: Mapping[str, str] | None = None
) -> str | None:
    """The request field a kvflow ValueError is about: its message's leading name, renamed by `aliases` (the
    engine's name -> the request's, e.g. `prompt_token_ids` -> `prompt`), when that is one of `fields`."""
    match = _LEADING_NAME.match(str(error))
    if match is None:
        return None
    name = match.group(1)
    if aliases:
        name = aliases.get(name, name)
    return name if name in fields else None


def bad_request(
    error: BaseException, fields: Collection[str], aliases: Mapping[str, str] | None = None
) -> OpenAIServingError:
    """A 400 for a ValueError raised while checking a request, naming the field it is about (the message without
    the engine's `SamplingParams.` prefix: the client never saw that class)."""
    message = str(error).removeprefix("SamplingParams.")
    return OpenAIServingError(message, param=param_of(error, fields, aliases))


def validation_param(errors: list[dict[str, object]]) -> str | None:
    """The field a pydantic validation error is about: the first name in its location after `body` or `query`
    (`("body", "messages", 0, "content")` -> "messages")."""
    for error in errors:
        location = error.get("loc") or ()
        names = [part for part in location if isinstance(part, str)]  # type: ignore[union-attr]
        if names and names[0] in ("body", "query", "path", "header"):
            names = names[1:]
        if names:
            return names[0]
    return None


def validation_message(errors: list[dict[str, object]]) -> str:
    """`temperature: Input should be a valid number; n: ...` (one part per error, in order)."""
    parts = []
    for error in errors:
        location = [str(part) for part in error.get("loc") or ()]  # type: ignore[union-attr]
        if location and location[0] in ("body", "query", "path", "header"):
            location = location[1:]
        where = ".".join(location)
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request"
