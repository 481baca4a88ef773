"""Every message that crosses the front end <-> engine-core process boundary, and how it is encoded.

The multiprocess client (`kvflow.engine.mp_client`) sends `InputMessage`s to the engine-core process
(`kvflow.engine.core_proc`) over one ZMQ socket (input) and receives `OutputMessage`s over another (output); each
frame is one msgspec-msgpack encoded message, tagged with its type, so a decoder given the union decodes exactly
these types. A ZMQ message of several frames is a batch: the core applies its messages with no step in between.

    client -> core   AddRequests, AbortRequests, UtilityCall, RunCallable, PauseGeneration, Shutdown
    core -> client   EngineReady | EngineStartupFailed (the handshake, first and once), then any number of
                     EngineCoreOutputs and UtilityResult in the order the core produced them, and
                     EngineCoreFailed when the engine loop dies

Invariants:
  * the hot path is typed: requests (`SamplingParams` inside), per-step outputs (`EngineCoreOutput`,
    `LogprobsLists`) and `SchedulerStats` are encoded by type, so a field added to one of those types crosses
    the boundary without a change here (its annotation must resolve at runtime to msgspec-encodable types);
  * every message but `Shutdown` carries a `call_id` and gets exactly one `UtilityResult` with that id (a pause's
    comes once it is in effect or released by a resume), unless the engine dies first;
  * generic payloads (a utility's arguments and results, a `run` callable, `collective_rpc` callables) travel as
    cloudpickle bytes inside their typed envelope, and only ever between a front end and the engine-core process it
    started, over ipc sockets in a private folder (never a network socket): unpickling runs code.
"""

from __future__ import annotations

import builtins
import logging
import traceback
from typing import Any

import cloudpickle
import msgspec

from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
from kvflow.lora.request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "AbortRequests",
    "AddRequests",
    "EngineCoreFailed",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineReady",
    "EngineStartupFailed",
    "InputMessage",
    "OutputMessage",
    "PauseGeneration",
    "RemoteError",
    "RunCallable",
    "Shutdown",
    "UtilityCall",
    "UtilityResult",
    "dumps",
    "loads",
    "make_input_decoder",
    "make_output_decoder",
]


def dumps(value: Any) -> bytes:
    """A generic payload (utility arguments and results, callables) as cloudpickle bytes."""
    return cloudpickle.dumps(value)


def loads(payload: bytes) -> Any:
    return cloudpickle.loads(payload)


# ------------------------------------------------------------------------------------------------ requests
class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A `Request` as it crosses the boundary: its constructor arguments (the core attaches its own block hasher).

    Invariant: `EngineCoreRequest.from_request(r).to_request()` has every constructor argument of `r` (tests check
    that this covers all of `Request.__init__`'s parameters but `block_hasher`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    resumable: bool = False
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None

    @classmethod
    def from_request(cls, request: Request) -> EngineCoreRequest:
        return cls(
            request.request_id,
            list(request.prompt_token_ids),
            request.sampling_params,
            request.eos_token_id,
            request.arrival_time,
            request.priority,
            request.resumable,
            request.cache_salt,
            request.lora_request,
            request.pooling_params,
        )

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=self.arrival_time,
            priority=self.priority,
            resumable=self.resumable,
            cache_salt=self.cache_salt,
            lora_request=self.lora_request,
            pooling_params=self.pooling_params,
        )


# ------------------------------------------------------------------------------------------------ client -> core
class AddRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Queue a prompt's requests (or a session's next chunk), all or nothing (`EngineCore.add_requests`)."""

    call_id: int
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    call_id: int
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True, array_like=True, gc=False):
    """`EngineCore.<method>(*loads(args))` between two steps; `method` is a public method of `EngineCore`."""

    call_id: int
    method: str
    args: bytes


class RunCallable(msgspec.Struct, tag=True, array_like=True, gc=False):
    """`loads(fn)(engine_core)` between two steps (inspection, administration and tests)."""

    call_id: int
    fn: bytes


class PauseGeneration(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Answered once the pause is in effect, or once a later resume released it."""

    call_id: int
    mode: str
    clear_cache: bool


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Stop the engine loop after the message before it, and exit."""


InputMessage = AddRequests | AbortRequests | UtilityCall | RunCallable | PauseGeneration | Shutdown


# ------------------------------------------------------------------------------------------------ core -> client
class RemoteError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An exception raised in the engine-core process, rebuilt on the caller's side by `to_exception`.

    `pickled` holds the exception itself when it pickles (then its type and attributes survive, also for classes the
    caller defined); otherwise a builtin exception type is rebuilt by name, anything else as RuntimeError. The
    engine process's traceback is attached as a note.
    """

    type_name: str
    message: str
    traceback: str = ""
    pickled: bytes | None = None

    @classmethod
    def from_exception(cls, error: BaseException) -> RemoteError:
        try:
            pickled: bytes | None = dumps(error)
        except Exception:
            pickled = None
        formatted = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return cls(type(error).__name__, str(error), formatted, pickled)

    def to_exception(self) -> BaseException:
        error: BaseException | None = None
        if self.pickled is not None:
            try:
                error = loads(self.pickled)
            except Exception:
                logger.debug("could not unpickle the engine's %s", self.type_name, exc_info=True)
        if not isinstance(error, BaseException):
            builtin = getattr(builtins, self.type_name, None)
            if isinstance(builtin, type) and issubclass(builtin, Exception):
                error = builtin(self.message)
            else:
                error = RuntimeError(f"{self.type_name}: {self.message}")
        if self.traceback and hasattr(error, "add_note"):
            error.add_note(f"raised in the engine-core process:\n{self.traceback.rstrip()}")
        return error


class EngineReady(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Handshake: the core is built and serving. `num_kv_blocks` is the KV cache the worker allocated."""

    pid: int
    num_kv_blocks: int


class EngineStartupFailed(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Handshake: building the core failed (e.g. ValueError: max_model_len does not fit the KV cache)."""

    error: RemoteError


class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One engine step's outputs and the scheduler's stats after that step."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats


class UtilityResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The answer to the call `call_id`: `loads(result)` (None when `result` is None), or `error`."""

    call_id: int
    result: bytes | None = None
    error: RemoteError | None = None


class EngineCoreFailed(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The engine loop died of `error`; the process exits after sending this."""

    error: RemoteError


OutputMessage = (
    EngineReady | EngineStartupFailed | EngineCoreOutputs | UtilityResult | EngineCoreFailed
)


def make_input_decoder() -> msgspec.msgpack.Decoder[InputMessage]:
    return msgspec.msgpack.Decoder(InputMessage)  # type: ignore[arg-type]


def make_output_decoder() -> msgspec.msgpack.Decoder[OutputMessage]:
    return msgspec.msgpack.Decoder(OutputMessage)  # type: ignore[arg-type]
