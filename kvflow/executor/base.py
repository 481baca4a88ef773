"""What every executor provides to the engine core, whatever runs its workers (this process, worker processes,
Ray actors)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

if TYPE_CHECKING:
    from concurrent.futures import Future

    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
    from kvflow.executor.messages import RunMethod
    from kvflow.model_info import ModelInfo


class Executor(ABC):
    """Runs one engine core's workers: `tensor_parallel_size` ranks, each holding its shard of the model.

    Invariants every executor keeps:
      * `num_kv_blocks` is what every rank can hold (the minimum over ranks): the scheduler's KV cache manager uses it;
      * `execute_model(so)` runs one step on every rank, in submission order, and returns rank 0's
        `ModelRunnerOutput`; with `non_block=True` it returns a Future of it (the engine's batch queue holds these
        Futures, so async scheduling works with every executor);
      * `collective_rpc` runs between steps on every rank and returns the results in rank order;
      * a rank that fails or dies makes every pending and later call raise an error naming the rank;
      * after `shutdown()` no worker process or actor of this executor is left.
    """

    name: ClassVar[str]
    num_kv_blocks: int

    @abstractmethod
    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        """Start the workers and wait until every rank has loaded its shard and sized its KV cache."""

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on every rank; rank 0's output (or a Future of it). A step with structured-output
        requests (`scheduler_output.has_structured_output_requests`) runs its forward pass only and returns None:
        `sample_tokens` finishes it."""

    @abstractmethod
    def sample_tokens(
        self, grammar_output: GrammarOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Sample the step whose forward pass ran last, under `grammar_output`'s bitmask, on every rank (in
        submission order with the steps); rank 0's output (or a Future of it)."""

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """`Worker.execute_method(method, args, kwargs)` on every rank; the results in rank order."""
        from kvflow.executor.messages import RunMethod  # cloudpickle: imported once a call is made

        return self._run_method(RunMethod(method, tuple(args), dict(kwargs or {})))

    @abstractmethod
    def _run_method(self, message: RunMethod) -> list[Any]:
        """`collective_rpc`'s call on every rank, between steps; the results in rank order."""

    def update_weights(self, weights: str | Any) -> None:
        """Load new weights on every rank (each reads its own shards of a checkpoint folder)."""
        self.collective_rpc("update_weights", (weights,))

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
