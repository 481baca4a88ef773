"""A request's own failure in a step: the errors that blame it, and the output that ends it alone.

Invariant: a failure here finishes one request (FINISHED_ERROR, finish_reason "error") and nothing else; the engine
and every other request go on.
"""

from __future__ import annotations

import logging

from kvflow.core.sched.output import EngineCoreOutput
from kvflow.request import Request, RequestStatus

# The scheduler's logger: these lines report what its step did to a request.
logger = logging.getLogger("kvflow.core.sched.scheduler")


class RequestFailedInStep(RuntimeError):
    """The worker could not run a request's part of a step (e.g. its sampling failed); the text says why."""


class StructuredOutputRejected(RuntimeError):
    """A sampled token that the request's grammar does not allow: the request ends, as its own fault
    (`client_error`). Sampling only picks a forbidden token when the grammar's tokens were all forbidden too, by the
    request's own logits controls (min_tokens' EOS ban, bad_words, allowed_token_ids, a -100 logit_bias), or when
    the grammar allows nothing (one without a finite string, e.g. `root ::= root`, or a dead end no token of the
    vocabulary continues)."""


def rejection_message(request: Request, token_id: int) -> str:
    """Why a constrained request sampled a token its grammar refuses, naming the fields that can cause it."""
    params = request.sampling_params
    num_output = request.num_output_tokens
    controls = [
        name
        for name, in_effect in (
            ("min_tokens", params.min_tokens > num_output),
            ("bad_words", bool(params.bad_words or params.bad_words_token_ids)),
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("logit_bias", bool(params.logit_bias)),
        )
        if in_effect
    ]
    where = f"after {num_output} output tokens"
    so_request = request.structured_output_request
    backend_error = (
        None if so_request is None or so_request.grammar is None else so_request.grammar.error()
    )
    if backend_error is not None:
        return f"structured_outputs: the backend's matcher failed {where}: {backend_error}"
    if controls:
        return (
            f"structured_outputs: no token the constraint allows {where} passes the request's "
            f"{' and '.join(controls)} (token {token_id} was sampled from what was left): the request contradicts "
            "itself"
        )
    return (
        f"structured_outputs: the constraint allows no token {where}: no token of the model's vocabulary "
        "continues it (a grammar without a finite string, such as `root ::= root`, or text the vocabulary cannot "
        f"spell from here); token {token_id} was sampled unconstrained"
    )


def fail_request(request: Request, error: Exception) -> EngineCoreOutput:
    """A request whose output could not be applied (a fault that is its own, e.g. a bad value that slipped past
    admission): logged with its traceback, marked FINISHED_ERROR (finish_reason "error", the error's text as
    `stop_reason`), and finished like a stopped request, so the engine and every other request go on. A
    `StructuredOutputRejected` (the request contradicts itself) is one WARNING line and `client_error` on the
    output (the API answers 400)."""
    client_error = isinstance(error, StructuredOutputRejected)
    if client_error:  # the request's own contradiction: one line, no traceback
        logger.warning("request %s ends with finish_reason 'error': %s", request.request_id, error)
    else:
        logger.error(
            "request %s failed in an engine step and ends with finish_reason 'error'",
            request.request_id,
            exc_info=error,
        )
    request.status = RequestStatus.FINISHED_ERROR
    request.resumable = False  # a streaming session ends with it
    return EngineCoreOutput(
        request.request_id,
        [],
        finish_reason=request.get_finished_reason(),
        stop_reason=str(error) if client_error else f"{type(error).__name__}: {error}",
        client_error=client_error,
    )
