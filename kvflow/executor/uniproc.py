"""UniProcExecutor: one worker in the engine's own process (optionally on a thread, for overlapped steps)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvflow.executor.base import Executor
from kvflow.worker.worker import Worker

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
    from kvflow.executor.messages import RunMethod
    from kvflow.model_info import ModelInfo


class UniProcExecutor(Executor):
    """Runs a single `Worker` in-process. `execute_model(..., non_block=True)` returns a Future: with a worker
    thread (`ParallelConfig.worker_thread`: "on", or "auto" on CUDA) the step runs on that one dedicated thread, so
    the caller schedules the next step meanwhile (PyTorch releases the GIL in its kernels); steps run one at a time,
    in submission order. Without it the step runs inline and the Future is already done. On a CPU device inline is
    the better choice: there the scheduler's Python work would take a core from PyTorch's OpenMP team, and the
    forward pass loses more than the overlap gains (see benchmarks/throughput.py).

    `num_kv_blocks` is what the worker allocated, which the scheduler's KV cache manager must use.
    """

    name = "uni"

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        self.worker = Worker(engine_config, model_info)
        self.num_kv_blocks = self.worker.num_kv_blocks
        worker_thread = engine_config.parallel_config.worker_thread
        self.uses_worker_thread = worker_thread == "on" or (
            worker_thread == "auto" and self.worker.device.type == "cuda"
        )
        self._thread: ThreadPoolExecutor | None = None

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if not non_block:
            return self.worker.execute_model(scheduler_output)
        if not self.uses_worker_thread:
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(self.worker.execute_model(scheduler_output))
            return done
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-worker")
        return self._thread.submit(self.worker.execute_model, scheduler_output)

    def sample_tokens(
        self, grammar_output: GrammarOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if not non_block:
            return self.worker.sample_tokens(grammar_output)
        if self._thread is None:
            done: Future[ModelRunnerOutput] = Future()
            done.set_result(self.worker.sample_tokens(grammar_output))
            return done
        return self._thread.submit(self.worker.sample_tokens, grammar_output)

    def update_weights(self, weights: str | Any) -> None:
        self.worker.update_weights(weights)

    def _run_method(self, message: RunMethod) -> list[Any]:
        """On the one rank here. With a worker thread the call queues behind the steps already submitted, so it
        never overlaps a step."""
        method, args, kwargs = message.method, message.args, message.kwargs
        if self._thread is None:
            return [self.worker.execute_method(method, args, kwargs)]
        return [self._thread.submit(self.worker.execute_method, method, args, kwargs).result()]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
