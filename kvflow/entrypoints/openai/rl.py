"""Engine-control endpoints for training loops: `GET /is_paused` always; the rest only with
`--enable-admin-endpoints` (RL trainers start the server with it; like vLLM, which registers them in dev mode only),
and behind `--api-key` like every route.

    GET  /is_paused                                           -> {"is_paused": bool}
  admin:
    POST /pause?mode=abort|wait|keep&clear_cache=true|false   -> {"status": "paused"} once the pause is in effect
    POST /resume                                              -> {"status": "resumed"}
    POST /reset_prefix_cache?reset_running_requests=false     -> 200 reset, 409 blocks still in use
    POST /abort_requests {"request_ids": [...]}               -> {"aborted": [...]}  (none given: every request)
    POST /update_weights {"path": folder}                     -> {"weight_version": N}  (409 unless paused)
    GET  /weight_version                                      -> {"weight_version": N}
    POST /collective_rpc {"method", "args", "kwargs"}         -> {"results": [...]}  (one per worker rank)

`/collective_rpc` calls public worker methods only (no leading underscore, not the engine's own step plumbing
`INTERNAL_WORKER_METHODS`), and `update_weights` through it needs a pause in effect, as `/update_weights` does (409).

Pause semantics are the engine's (`kvflow.engine.core.Pause`): "abort" ends every request with finish_reason "abort"
(partial outputs kept), "wait" lets started requests finish, "keep" freezes everything, streams included, until
/resume; requests that arrive meanwhile wait and run after /resume. vLLM's deprecated `wait_for_inflight_requests=true`
means mode "wait".
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder

from kvflow.engine.core import PAUSE_MODES, EngineNotPausedError
from kvflow.engine.core_proc import ABORT_EVERYWHERE
from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol import (
    AbortRequestsRequest,
    CollectiveRpcRequest,
    UpdateWeightsRequest,
)

if TYPE_CHECKING:
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.engine.core import EngineCore
    from kvflow.entrypoints.openai.serving_engine import LiveRequests

logger = logging.getLogger(__name__)

# Worker methods the engine itself drives: called from outside they would break its invariants.
INTERNAL_WORKER_METHODS = frozenset({"execute_model", "execute_method"})


class RLControl:
    """The engine-control side of the server.

    Invariant: `weight_version` is the engine's weight version (0 at start; only `update_weights` changes it, and
    it goes through here).

    `shared_engine` (one of several API server processes, `kvflow serve --api-server-count N`): the engine cores
    serve other API processes too, so pause / resume / is_paused / reset_prefix_cache / update_weights act on
    every process's requests already (the cores are shared); `abort_requests` also aborts what the other
    processes run (`ABORT_EVERYWHERE`: each owner's streams end with finish_reason "abort"), and
    `current_weight_version` asks the cores, since an update may have gone through another process.
    """

    def __init__(
        self, engine: AsyncLLM, live_requests: LiveRequests, shared_engine: bool = False
    ) -> None:
        self.engine = engine
        self.live_requests = live_requests
        self.shared_engine = shared_engine
        self.weight_version = 0

    async def pause(self, mode: str, clear_cache: bool) -> None:
        if mode not in PAUSE_MODES:
            raise OpenAIServingError(
                f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode"
            )
        await self.engine.pause_generation(mode, clear_cache)
        logger.info("generation paused (mode=%s, clear_cache=%s)", mode, clear_cache)

    async def resume(self) -> None:
        await self.engine.resume_generation()
        logger.info("generation resumed")

    async def reset_prefix_cache(self, reset_running_requests: bool) -> None:
        if not await self.engine.reset_prefix_cache(reset_running_requests):
            raise OpenAIServingError(
                "the prefix cache was not reset: KV blocks are still in use by requests; retry when idle, or "
                "pass reset_running_requests=true to preempt them (they recompute)",
                status_code=HTTPStatus.CONFLICT,
            )

    async def abort_requests(self, request_ids: list[str] | None) -> list[str]:
        """Abort the live requests among `request_ids` (all live ones for None or []); returns those aborted.
        With a shared engine, also those of the other API processes: the ids given that another process held
        (matched by the server's id conventions, `core_proc.matching_request_ids`), or, for all, the engine
        request ids of every other process's requests."""
        found = self.live_requests.resolve(request_ids or None)
        await self.engine.abort([engine_id for ids in found.values() for engine_id in ids])
        aborted = list(found)
        if self.shared_engine:
            others = (
                None if not request_ids else [each for each in request_ids if each not in found]
            )
            if others is None or others:
                for each in await self._abort_everywhere(others):
                    if each not in found:
                        aborted.append(each)
        return list(dict.fromkeys(aborted))

    async def _abort_everywhere(self, request_ids: list[str] | None) -> list[str]:
        """`ABORT_EVERYWHERE` on every engine core; the ids they report, once each."""
        results = await asyncio.wrap_future(
            self.engine.engine_core_client.call_utility(ABORT_EVERYWHERE, request_ids)
        )
        per_core = results if self.engine.data_parallel_size > 1 else [results]
        return list(dict.fromkeys(each for core in per_core for each in core))

    async def current_weight_version(self) -> int:
        """The weight version: the engine cores' own with a shared engine, else `weight_version`."""
        if not self.shared_engine:
            return self.weight_version
        return max(await self.engine.run_in_each_engine(_engine_weight_version))

    async def update_weights(self, path: str) -> int:
        if not await self.engine.is_paused():
            raise OpenAIServingError(
                "update_weights needs a paused engine: POST /pause first",
                status_code=HTTPStatus.CONFLICT,
            )
        try:
            self.weight_version = await self.engine.update_weights(path)
        except (
            EngineNotPausedError
        ) as error:  # the pause has not taken effect ("wait" still draining)
            raise OpenAIServingError(str(error), status_code=HTTPStatus.CONFLICT) from error
        except (ValueError, OSError) as error:
            raise OpenAIServingError(f"cannot load weights: {error}", param="path") from error
        return self.weight_version

    async def collective_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any]
    ) -> list[Any]:
        if method.startswith("_") or method in INTERNAL_WORKER_METHODS:
            raise OpenAIServingError(
                f"method must name a public worker method, and {method!r} is not one",
                param="method",
            )
        try:
            results = await self.engine.collective_rpc(method, args=tuple(args), kwargs=kwargs)
        except EngineNotPausedError as error:
            raise OpenAIServingError(str(error), status_code=HTTPStatus.CONFLICT) from error
        except (AttributeError, TypeError, ValueError) as error:
            raise OpenAIServingError(f"{type(error).__name__}: {error}", param="method") from error
        return [_jsonable(result) for result in results]


def _engine_weight_version(engine_core: EngineCore) -> int:
    return engine_core.weight_version


def _jsonable(value: Any) -> Any:
    try:
        return jsonable_encoder(value)
    except (TypeError, ValueError):
        return repr(value)


def _control(raw_request: Request) -> RLControl:
    return raw_request.app.state.rl_control


control_router = APIRouter()


@control_router.get("/is_paused")
async def is_paused(raw_request: Request) -> dict[str, bool]:
    return {"is_paused": await _control(raw_request).engine.is_paused()}


admin_router = APIRouter()


@admin_router.post("/pause")
async def pause(
    raw_request: Request,
    mode: str = "abort",
    clear_cache: bool = True,
    wait_for_inflight_requests: bool = False,
) -> dict[str, str]:
    await _control(raw_request).pause("wait" if wait_for_inflight_requests else mode, clear_cache)
    return {"status": "paused"}


@admin_router.post("/resume")
async def resume(raw_request: Request) -> dict[str, str]:
    await _control(raw_request).resume()
    return {"status": "resumed"}


@admin_router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    raw_request: Request, reset_running_requests: bool = False
) -> dict[str, str]:
    await _control(raw_request).reset_prefix_cache(reset_running_requests)
    return {"status": "reset"}


@admin_router.post("/abort_requests")
async def abort_requests(
    raw_request: Request, body: AbortRequestsRequest | None = None
) -> dict[str, list[str]]:
    request_ids = body.request_ids if body is not None else None
    return {"aborted": await _control(raw_request).abort_requests(request_ids)}


@admin_router.post("/update_weights")
async def update_weights(raw_request: Request, body: UpdateWeightsRequest) -> dict[str, int]:
    return {"weight_version": await _control(raw_request).update_weights(body.path)}


@admin_router.get("/weight_version")
async def weight_version(raw_request: Request) -> dict[str, int]:
    return {"weight_version": await _control(raw_request).current_weight_version()}


@admin_router.post("/collective_rpc")
async def collective_rpc(raw_request: Request, body: CollectiveRpcRequest) -> dict[str, list[Any]]:
    results = await _control(raw_request).collective_rpc(body.method, body.args, body.kwargs)
    return {"results": results}
