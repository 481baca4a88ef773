"""Engine-core clients: how a front end drives an `EngineCore` that it does not step itself.

`EngineCoreClient` is the interface both front ends (`LLM` and `AsyncLLM`) are written against; neither touches an
`EngineCore` or its scheduler. `InprocEngineCoreClient` runs the core's `EngineLoop` (`kvflow.engine.loop`) on a
thread of this process; `kvflow.engine.mp_client.MPEngineCoreClient` talks (ZMQ + msgspec) to an
engine-core process that runs the same `EngineLoop` on its main thread; `kvflow.engine.dp_client.DPEngineCoreClient`
drives several such processes as one (data parallelism). Every call is a message carrying plain data, so nothing
here assumes the core shares this memory, except `run`, which ships a callable (for inspection and tests; across
processes it travels with cloudpickle). Engine death is `kvflow.engine.death.EngineDeath`'s, the same for all.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from kvflow.engine.death import (
    DeadHandler,
    EngineDeadError,
    EngineDeath,
    dead_error_for,
    fresh_dead_error,
)
from kvflow.engine.futures import complete, gather
from kvflow.engine.loop import (
    EngineLoop,
    LoopCall,
    LoopMessage,
    LoopPause,
    LoopShutdown,
    OutputHandler,
)

if TYPE_CHECKING:
    from kvflow.engine.core import EngineCore
    from kvflow.lora.request import LoRARequest
    from kvflow.request import Request

__all__ = [
    "EngineCoreClient",
    "EngineDeadError",
    "InprocEngineCoreClient",
    "OutputHandler",
    "complete",
    "dead_error_for",
    "fresh_dead_error",
    "gather",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_SHUTDOWN_JOIN_S = 60.0


class EngineCoreClient(ABC):
    """The front end's handle on one engine core.

    Invariants every implementation keeps:
      * messages are applied in the order sent, each between two engine steps; each returns a Future;
      * the core's outputs reach the `output_handler` given at construction, one step's outputs (with the
        scheduler's stats after that step) per call, in step order, from one thread at a time; all outputs produced
        before a message was applied are handled before that message's Future completes;
      * once the core stops (`shutdown`, or an error: `dead_error.__cause__`), `dead_handler` is called once,
        every pending Future fails with `EngineDeadError`, and every later call raises it.
    """

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        """Run `EngineCore.<method>(*args)` between steps; the Future holds its result or exception."""

    @abstractmethod
    def pause_generation(self, mode: str, clear_cache: bool) -> Future[None]:
        """Pause the core (semantics: `kvflow.engine.core.Pause`); completes once the pause is in effect or a
        later `resume_generation` released it. Mode "abort"'s outputs reach the output handler first."""

    @abstractmethod
    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        """Run `fn(engine_core)` between steps (inspection, administration and tests)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core (idempotent; returns once it has stopped)."""

    @property
    @abstractmethod
    def dead_error(self) -> EngineDeadError | None:
        """The error every call raises once the core has stopped; None while it runs."""

    # ------------------------------------------------------------------------------------------------ utilities
    def add_requests(self, requests: list[Request]) -> Future[None]:
        """Queue a prompt's requests, or a streaming session's next chunk; all or nothing (ValueError)."""
        return self.call_utility("add_requests", requests)

    def add_request_groups(self, groups: list[list[Request]]) -> Future[None]:
        """Queue several prompts' requests (`LLM.generate`'s whole call), each group all or nothing; the Future
        fails with the first refusal. Here one `add_requests` per group (a data-parallel client routes each group
        on its own); the in-process client sends all of them in one message, so no step runs with only some."""
        return _all_done([self.add_requests(group) for group in groups])

    def abort_requests(self, request_ids: list[str]) -> Future[None]:
        return self.call_utility("abort_requests", request_ids)

    def close_session(self, request_id: str) -> Future[bool]:
        """True: the session ended at once, and no output will report it (see `EngineCore.close_session`)."""
        return self.call_utility("close_session", request_id)

    def resume_generation(self) -> Future[None]:
        return self.call_utility("resume_generation")

    def is_paused(self) -> Future[bool]:
        return self.call_utility("is_paused")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Future[bool]:
        return self.call_utility("reset_prefix_cache", reset_running_requests)

    def update_weights(self, weights: Any) -> Future[int]:
        return self.call_utility("update_weights", weights)

    def add_lora(self, lora_request: LoRARequest) -> Future[bool]:
        """Load an adapter on every rank now (`EngineCore.add_lora`); the Future fails with a ValueError for a bad
        adapter."""
        return self.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> Future[bool]:
        return self.call_utility("remove_lora", lora_int_id)

    def pin_lora(self, lora_int_id: int) -> Future[bool]:
        return self.call_utility("pin_lora", lora_int_id)

    def list_loras(self) -> Future[set[int]]:
        return self.call_utility("list_loras")

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Future[list[Any]]:
        """`EngineCore.collective_rpc`: a worker method by name, or a callable taking the worker first, on every
        rank; the Future holds the results in rank order."""
        return self.call_utility("collective_rpc", method, tuple(args), dict(kwargs or {}))

    def is_alive(self) -> bool:
        """Whether the engine loop (thread or process) still runs."""
        return self.dead_error is None

    @property
    def num_engines(self) -> int:
        """How many engine cores this client drives (data parallelism: more than one)."""
        return 1

    def run_each(self, fn: Callable[[EngineCore], _T]) -> Future[list[_T]]:
        """`run(fn)` on every engine core; the Future holds the results in core order."""
        return gather([self.run(fn)], lambda results: results)


class InprocEngineCoreClient(EngineCoreClient):
    """Runs the core's `EngineLoop` on one dedicated thread of this process, the only thread that touches it.

    Invariant: "the engine is alive" and "the message is queued" are one step under the death's lock, so no
    message is queued after the loop drained its queue.
    """

    def __init__(
        self,
        engine_core: EngineCore,
        output_handler: OutputHandler,
        dead_handler: DeadHandler,
    ) -> None:
        self._death = EngineDeath(dead_handler)
        self._loop = EngineLoop(engine_core, output_handler, self._death)
        self._thread = threading.Thread(
            target=self._loop.run, name="kvflow-engine-core", daemon=True
        )
        self._thread.start()

    @classmethod
    def built_on_loop_thread(
        cls,
        build: Callable[[], EngineCore],
        output_handler: OutputHandler,
        dead_handler: DeadHandler,
    ) -> tuple[InprocEngineCoreClient, EngineCore]:
        """A client whose core `build()` makes on the loop's own thread, which then runs the loop; returns once the
        core is built, raising what `build` raised (the thread then ends, no dead handler is called).

        Why the thread matters: libgomp keeps one OpenMP thread pool per thread that starts a parallel region, and
        once it manages more threads than the process has CPUs it lets idle workers spin only ~1000 times before
        they sleep, so every region of a forward pass pays a futex wake-up. A core built on the caller's thread
        (model loading, warm-up) and stepped on the loop thread leaves two pools; built and stepped on one thread,
        the forward's regions keep their workers spinning (decode of a 1B Q4_K_M model: 27-33 against 31-38 ms a
        token on 2 cores, benchmarks/RESULTS.md)."""
        client = cls.__new__(cls)
        client._death = EngineDeath(dead_handler)
        built: Future[EngineCore] = Future()
        caller_gone = threading.Event()
        start_lock = (
            threading.Lock()
        )  # the loop starts, or the interrupted caller is seen: one or the other

        def build_and_run() -> None:
            try:
                engine_core = build()
            except BaseException as exc:  # reaches the caller, which waits on `built`
                built.set_exception(exc)
                return
            with start_lock:
                if (
                    caller_gone.is_set()
                ):  # the caller was interrupted while this built: never started
                    engine_core.shutdown()
                    return
                client._loop = EngineLoop(engine_core, output_handler, client._death)
                built.set_result(engine_core)
            client._loop.run()

        client._thread = threading.Thread(
            target=build_and_run, name="kvflow-engine-core", daemon=True
        )
        client._thread.start()
        try:
            return client, built.result()
        except BaseException:
            # Interrupted (Ctrl-C) while the core was being built: the build ends before this raises, so that the
            # process never exits with torch still running on that thread (which aborts it).
            with start_lock:
                caller_gone.set()
                started = built.done() and built.exception() is None
            if started:  # interrupted just as the loop started: stop it
                client.shutdown()
            client._thread.join()
            raise

    # ------------------------------------------------------------------------------------------------ callers
    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        return self.run(lambda core: getattr(core, method)(*args))

    def add_request_groups(self, groups: list[list[Request]]) -> Future[None]:
        return self.call_utility("add_request_groups", groups)

    def pause_generation(self, mode: str, clear_cache: bool) -> Future[None]:
        done: Future[None] = Future()
        self._send(LoopPause(mode, clear_cache, done))
        return done

    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        done: Future[_T] = Future()
        self._send(LoopCall(fn, done))
        return done

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._death.error

    def shutdown(self) -> None:
        with self._death.lock:
            if not self._death.is_dead:
                self._death.publish_locked()
                self._loop.put(LoopShutdown())
        if threading.current_thread() is not self._thread:
            self._thread.join(_SHUTDOWN_JOIN_S)
            if self._thread.is_alive():
                logger.warning("the engine loop did not stop within %.0f s", _SHUTDOWN_JOIN_S)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, message: LoopMessage) -> None:
        with self._death.lock:
            self._death.raise_if_dead()
            self._loop.put(message)


def _all_done(futures: list[Future[None]]) -> Future[None]:
    """A Future that completes when every one of `futures` has: with the first exception among them (in order),
    else None."""
    done: Future[None] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def on_done(_: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [future.exception() for future in futures if future.exception() is not None]
        if errors:
            done.set_exception(errors[0])
        else:
            done.set_result(None)

    if not futures:
        done.set_result(None)
    for future in futures:
        future.add_done_callback(on_done)
    return done
