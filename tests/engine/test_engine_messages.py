"""The messages between a front end and its engine-core process: every type survives msgspec encode -> decode
unchanged, requests keep every constructor argument, and errors come back as the exception they were."""

from __future__ import annotations

import inspect
import math
from typing import Any

import msgspec
import pytest

from kvflow.core.sched.output import EngineCoreOutput, LogprobsLists, SchedulerStats
from kvflow.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartupFailed,
    PauseGeneration,
    RemoteError,
    RunCallable,
    Shutdown,
    UtilityCall,
    UtilityResult,
    dumps,
    loads,
    make_input_decoder,
    make_output_decoder,
)
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

ENCODER = msgspec.msgpack.Encoder()


def round_trip(message: Any, decoder: msgspec.msgpack.Decoder[Any]) -> Any:
    decoded = decoder.decode(ENCODER.encode(message))
    assert type(decoded) is type(message)
    return decoded


def rich_params() -> SamplingParams:
    """Every field (of today's) away from its default, so a field lost on the way would show. New fields cross by
    type (msgspec encodes every dataclass field), so they need no change in kvflow.engine.messages."""
    return SamplingParams(
        n=1,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        max_tokens=77,
        min_tokens=3,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 9],
        ignore_eos=True,
        logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        output_kind="delta",
    )


def test_requests_round_trip_with_every_constructor_argument() -> None:
    request = Request(
        "req-1",
        [5, 6, 7],
        rich_params(),
        eos_token_id=2,
        arrival_time=123.25,
        priority=-3,
        resumable=True,
        cache_salt="salt",
    )
    message = AddRequests(41, [EngineCoreRequest.from_request(request)])
    decoded = round_trip(message, make_input_decoder())
    assert decoded == message
    rebuilt = decoded.requests[0].to_request()
    carried = [name for name in inspect.signature(Request).parameters if name != "block_hasher"]
    for name in carried:  # a new Request argument must cross the boundary too
        assert getattr(rebuilt, name) == getattr(request, name), name
    assert rebuilt.sampling_params == request.sampling_params
    assert rebuilt.streaming_queue is not None  # resumable, rebuilt as such


def test_a_sampling_params_that_fails_validation_does_not_decode() -> None:
    frame = ENCODER.encode(AddRequests(1, [EngineCoreRequest("r", [1], SamplingParams())]))
    broken = frame.replace(b"cumulative", b"sideways!!")
    with pytest.raises(msgspec.ValidationError, match="output_kind"):
        make_input_decoder().decode(broken)


@pytest.mark.parametrize(
    "message",
    [
        AbortRequests(3, ["a", "b"]),
        AbortRequests(4, []),
        UtilityCall(5, "reset_prefix_cache", dumps((True,))),
        RunCallable(6, dumps(len)),
        PauseGeneration(7, "keep", False),
        Shutdown(),
    ],
    ids=lambda message: type(message).__name__,
)
def test_control_messages_round_trip(message: Any) -> None:
    assert round_trip(message, make_input_decoder()) == message


def test_utility_arguments_and_callables_travel_pickled() -> None:
    scale = 3
    call = round_trip(
        UtilityCall(9, "collective_rpc", dumps((lambda worker: worker * scale, (), {}))),
        make_input_decoder(),
    )
    function, args, kwargs = loads(call.args)
    assert (function(2), args, kwargs) == (6, (), {})


def test_step_outputs_with_logprobs_and_stats_round_trip() -> None:
    logprobs = LogprobsLists([[11, 3], [12, 4]], [[-0.125, -2.5], [-math.inf, -1.0]], [0, 1])
    outputs = EngineCoreOutputs(
        [
            EngineCoreOutput(
                "a",
                [11, 12],
                finish_reason="stop",
                stop_reason=12,
                num_cached_tokens=16,
                new_logprobs=logprobs,
                weight_version=2,
            ),
            EngineCoreOutput("b", [], finish_reason="abort", stop_reason="END"),
            EngineCoreOutput("s", [9], finish_reason="length", session_continues=True),
        ],
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=1,
            kv_cache_usage=0.375,
            prefix_cache_query_tokens=100,
            prefix_cache_hit_tokens=48,
            num_preemptions_total=3,
        ),
    )
    decoded = round_trip(outputs, make_output_decoder())
    assert decoded == outputs
    assert [output.finished for output in decoded.outputs] == [True, True, False]
    assert isinstance(decoded.outputs[0].new_logprobs, LogprobsLists)


@pytest.mark.parametrize(
    "event",
    [
        EngineReady(pid=1234, num_kv_blocks=512),
        UtilityResult(8),
        UtilityResult(8, result=dumps({"weights": [1, 2]})),
        UtilityResult(8, error=RemoteError.from_exception(ValueError("bad"))),
        EngineStartupFailed(RemoteError.from_exception(ValueError("max_model_len=9"))),
        EngineCoreFailed(RemoteError.from_exception(RuntimeError("device lost"))),
    ],
    ids=lambda event: type(event).__name__,
)
def test_handshake_results_and_failures_round_trip(event: Any) -> None:
    assert round_trip(event, make_output_decoder()) == event


class DeviceLost(RuntimeError):
    pass


class Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("not picklable")


def test_errors_come_back_as_the_exception_raised() -> None:
    try:
        raise DeviceLost("device lost")
    except DeviceLost as error:
        remote = RemoteError.from_exception(error)
    rebuilt = round_trip(UtilityResult(1, error=remote), make_output_decoder()).error.to_exception()
    assert type(rebuilt) is DeviceLost and str(rebuilt) == "device lost"
    assert "raise DeviceLost" in "".join(rebuilt.__notes__)  # the engine process's traceback

    value_error = RemoteError.from_exception(ValueError("max_model_len=64 does not fit"))
    rebuilt_value_error = value_error.to_exception()
    assert type(rebuilt_value_error) is ValueError
    assert str(rebuilt_value_error) == "max_model_len=64 does not fit"


def test_an_unpicklable_error_falls_back_to_its_builtin_base_or_a_runtime_error() -> None:
    remote = RemoteError.from_exception(Unpicklable("odd"))
    assert remote.pickled is None
    rebuilt = remote.to_exception()
    assert type(rebuilt) is RuntimeError and str(rebuilt) == "Unpicklable: odd"
    key_error = RemoteError("KeyError", "'x'").to_exception()
    assert type(key_error) is KeyError
