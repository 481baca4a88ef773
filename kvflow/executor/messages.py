"""Every message between a distributed executor (in the engine-core process) and its rank workers.

    executor -> every rank (one broadcast)   (call_id, ExecuteModel | SampleTokens | RunMethod | StopWorker)
    rank -> executor                          WorkerReady (startup), WorkerReply (answers)

A broadcast is serialized once for all ranks (pickle; a `RunMethod`, which may carry a callable, with cloudpickle)
and only ever travels over ipc sockets in a private folder or Ray's object store, between an engine and the workers
it started: unpickling runs code. Only rank 0 answers `ExecuteModel` and `SampleTokens` (its
`ModelRunnerOutput` stands for all ranks; None for a forward pass whose sampling waits for `SampleTokens`);
every rank answers `RunMethod`; any rank answers a failure.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import GrammarOutput, SchedulerOutput
    from kvflow.model_info import ModelInfo

# The call id of a rank's startup answer (`WorkerReady`, or a `WorkerReply` with the startup error).
STARTUP_CALL_ID = -1


@dataclass(frozen=True)
class RankStartup:
    """What a rank needs to join its group and build its worker.

    `dist_init_method` is rank 0's torch.distributed store (`tcp://host:port`); `num_threads` the intra-op
    threads this rank may use (its share of the host's cores on CPU; 0: leave PyTorch's default)."""

    engine_config: EngineConfig
    model_info: ModelInfo | None
    rank: int
    world_size: int
    dist_init_method: str
    num_threads: int

    @classmethod
    def for_every_rank(
        cls,
        engine_config: EngineConfig,
        model_info: ModelInfo | None,
        world_size: int,
        dist_init_method: str,
        num_threads: int,
    ) -> list[RankStartup]:
        """The startups of ranks 0 .. world_size - 1, alike but for `rank`."""
        return [
            cls(engine_config, model_info, rank, world_size, dist_init_method, num_threads)
            for rank in range(world_size)
        ]


@dataclass(frozen=True)
class ExecuteModel:
    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class SampleTokens:
    """Sample the step whose forward pass ran last (its `ExecuteModel` had structured-output requests), with the
    step's grammar bitmask. Answered like a step: by rank 0, or by any rank that failed."""

    grammar_output: GrammarOutput


@dataclass(frozen=True)
class RunMethod:
    """`Worker.execute_method(method, args, kwargs)` on every rank."""

    method: str | Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StopWorker:
    """Leave the loop and exit (no answer)."""


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    num_kv_blocks: int


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised on a rank: its pickled form when it pickles (so the caller can raise the same type),
    and its text and traceback always."""

    exception_bytes: bytes | None
    description: str
    traceback_text: str

    @staticmethod
    def from_exception(error: BaseException) -> RemoteFailure:
        try:
            exception_bytes: bytes | None = cloudpickle.dumps(error)
        except Exception:
            exception_bytes = None
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return RemoteFailure(exception_bytes, f"{type(error).__name__}: {error}", text)

    def to_exception(self, rank: int) -> BaseException:
        """The rank's exception, of its own type where it can be rebuilt, its message naming the rank."""
        where = f"tensor-parallel rank {rank}"
        if self.exception_bytes is not None:
            try:
                original = pickle.loads(self.exception_bytes)
                if isinstance(original, Exception) and not isinstance(original, OSError):
                    rebuilt = type(original)(f"{where}: {original}")
                    rebuilt.__cause__ = RuntimeError(self.traceback_text)
                    return rebuilt
            except Exception:
                pass
        return RuntimeError(f"{where} failed: {self.description}\n{self.traceback_text}")


@dataclass(frozen=True)
class WorkerReply:
    """A rank's answer to call `call_id`: its `result`, or `failure`."""

    rank: int
    call_id: int
    result: Any = None
    failure: RemoteFailure | None = None


def encode_broadcast(
    call_id: int, message: ExecuteModel | SampleTokens | RunMethod | StopWorker
) -> bytes:
    """One frame for every rank: pickle, except that a `RunMethod` (callables, closures) goes through cloudpickle."""
    if isinstance(message, RunMethod):
        return cloudpickle.dumps((call_id, message))
    return pickle.dumps((call_id, message), protocol=pickle.HIGHEST_PROTOCOL)


def encode_reply(reply: WorkerReply | WorkerReady) -> bytes:
    """A rank's answer (results of `collective_rpc` may be anything cloudpickle handles)."""
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return cloudpickle.dumps(reply)
