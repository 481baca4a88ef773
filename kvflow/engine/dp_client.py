"""DPEngineCoreClient: data parallelism, N engine-core processes behind one front end.

    front end (AsyncLLM / kvflow serve)
      DPEngineCoreClient ── add_requests ──> the least-loaded core (then every call about that request goes there)
        │                ── pause / resume / reset_prefix_cache / update_weights / collective_rpc ──> every core
        ├─ MPEngineCoreClient 0 ── engine-core process 0 (scheduler, KV cache, workers)
        └─ MPEngineCoreClient 1 ── engine-core process 1
      each core's output thread ──> one output handler, called by one thread at a time, stats stamped with the
                                    core's `engine_index`

Every core is a whole engine (its own scheduler, KV cache and workers: a tensor-parallel group when
`tensor_parallel_size > 1`); a request lives on exactly one core from its `add_requests` to its finished output (or
its abort). The cores start together (in parallel threads) and the front end is ready once all are.

Load: a core's load is the number of live requests it owns, which is its scheduler's waiting + running (the counts
its per-step `SchedulerStats` report) plus the requests sent to it that no step has reported yet, without the
step of lag: a burst of requests arriving between two steps spreads evenly, and an aborted request stops counting at
once (an abort produces no step, so the stats would keep counting it until the core's next output). Ties go round
the cores in turn.

With `attachments` (`kvflow serve --api-server-count N`), the cores already run, shared with other front ends: each
`MPEngineCoreClient` attaches to its core instead of starting one, and stopping detaches (the launcher stops the
cores). Routing is per front end: each balances its own requests by its own counts.

A core that dies takes the whole engine down, as a single core's death does (`MPEngineCoreClient`): every stream
in flight ends once with an `EngineDeadError` naming the core, `/health` turns 503, the other cores are stopped,
and every later call raises the error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from kvflow.engine.core_client import EngineCoreClient
from kvflow.engine.death import DeadHandler, EngineDeadError, EngineDeath, fresh_dead_error
from kvflow.engine.futures import gather
from kvflow.engine.loop import OutputHandler
from kvflow.engine.mp_client import STARTUP_TIMEOUT_S, MPEngineCoreClient
from kvflow.engine.placement import core_devices

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
    from kvflow.engine.core import EngineCore
    from kvflow.engine.shared_engines import EngineAttachment
    from kvflow.lora.request import LoRARequest
    from kvflow.model_info import ModelInfo
    from kvflow.request import Request

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class DPEngineCoreClient(EngineCoreClient):
    """An `EngineCoreClient` over `data_parallel_size` engine-core processes, one `MPEngineCoreClient` each.

    Invariants:
      * `_owner` maps every live request id to the index of the core it was sent to; a request's later calls
        (abort, a streaming session's next chunk, close_session) go to that core; `_load[i]` is how many ids
        `_owner` maps to core i. An id stops being live when its finished output arrives, when it is aborted, or
        when the core rejects it;
      * broadcast calls (pause, resume, reset_prefix_cache, update_weights, collective_rpc, is_paused) reach every
        core and complete once every core answered; their results combine in core order;
      * the output handler runs on one thread at a time (`_handler_lock`), with `SchedulerStats.engine_index` set
        to the core the outputs came from;
      * the engine is dead once `shutdown` begins or any core dies; then the dead handler is called once, the other
        cores are stopped, and every later call raises `dead_error`; `shutdown` returns once every process is gone.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        model_info: ModelInfo | None,
        output_handler: OutputHandler,
        dead_handler: DeadHandler,
        data_parallel_size: int,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        attachments: Sequence[EngineAttachment] | None = None,
    ) -> None:
        """`attachments`: the running cores to attach to, one per rank (None: start them)."""
        if attachments is not None and len(attachments) != data_parallel_size:
            raise ValueError(
                f"{len(attachments)} engine cores to attach to for data_parallel_size={data_parallel_size}"
            )
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        self._output_handler = output_handler
        self._lock = (
            threading.RLock()
        )  # Future callbacks may run at once, on the thread that holds it
        self._death = EngineDeath(self._forget_all_then(dead_handler), self._lock)
        self._handler_lock = threading.Lock()
        self._owner: dict[str, int] = {}
        self._load = [0] * data_parallel_size
        self._next_on_tie = 0
        self._stopper: threading.Thread | None = None
        self._clients: list[MPEngineCoreClient] = self._start_cores(
            engine_config, model_info, data_parallel_size, startup_timeout_s, attachments
        )
        if self._death.is_dead:  # a core died while the others were starting
            self._stop_cores()
            self._death.raise_if_dead()
        self.pids = [client.pid for client in self._clients]
        self.num_kv_blocks_per_engine = [client.num_kv_blocks for client in self._clients]
        logger.info(
            "%d data-parallel engine cores ready (pids %s; KV blocks %s)",
            data_parallel_size,
            self.pids,
            self.num_kv_blocks_per_engine,
        )

    def _start_cores(
        self,
        engine_config: EngineConfig,
        model_info: ModelInfo | None,
        data_parallel_size: int,
        startup_timeout_s: float,
        attachments: Sequence[EngineAttachment] | None = None,
    ) -> list[MPEngineCoreClient]:
        """Start every core at once (or attach to each); if any fails, stop the others and raise the first core's
        error."""

        devices = (
            core_devices(engine_config, data_parallel_size)
            if attachments is None
            else [None] * data_parallel_size
        )

        def start(index: int) -> MPEngineCoreClient:
            return MPEngineCoreClient(
                engine_config,
                model_info,
                partial(self._handle_outputs, index),
                partial(self._on_core_dead, index),
                startup_timeout_s,
                data_parallel_rank=index,
                data_parallel_size=data_parallel_size,
                visible_devices=devices[index],
                attachment=None if attachments is None else attachments[index],
            )

        with ThreadPoolExecutor(data_parallel_size, thread_name_prefix="kvflow-dp-start") as pool:
            starting = [pool.submit(start, index) for index in range(data_parallel_size)]
        errors = [error for each in starting if (error := each.exception()) is not None]
        if errors:
            self._death.publish()  # stopping what started is no failure
            self._death.mark_reported()  # the front end never had an engine to lose
            for each in starting:
                if each.exception() is None:
                    each.result().shutdown()
            raise errors[0]
        return [each.result() for each in starting]

    # ------------------------------------------------------------------------------------------------ routing
    @property
    def num_engines(self) -> int:
        return len(self._clients)

    def engine_loads(self) -> list[int]:
        """Live requests per core, in core order (what routing compares)."""
        with self._lock:
            return list(self._load)

    def _pick_core(self) -> int:
        """The least-loaded core; ties go round the cores in turn (caller holds `_lock`)."""
        num_engines = len(self._load)
        start = self._next_on_tie
        index = min(
            range(num_engines), key=lambda each: (self._load[each], (each - start) % num_engines)
        )
        self._next_on_tie = (index + 1) % num_engines
        return index

    def _claim(self, request_ids: list[str], index: int) -> None:
        for request_id in request_ids:
            if self._owner.get(request_id) != index:
                self._release(request_id)
                self._owner[request_id] = index
                self._load[index] += 1

    def _release(self, request_id: str, index: int | None = None) -> None:
        """Forget a live request (only if core `index` owns it, when given); caller holds `_lock`."""
        owner = self._owner.get(request_id)
        if owner is None or (index is not None and owner != index):
            return
        del self._owner[request_id]
        self._load[owner] -= 1

    def add_requests(self, requests: list[Request]) -> Future[None]:
        """Send a prompt's requests (all n of them) to one core: the one that owns them already (a streaming
        session's next chunk), else the least loaded."""
        request_ids = [request.request_id for request in requests]
        with self._lock:
            self._check_alive()
            owners = {self._owner[each] for each in request_ids if each in self._owner}
            index = min(owners) if owners else self._pick_core()
            self._claim(request_ids, index)
            try:
                added = self._clients[index].add_requests(requests)
            except EngineDeadError as error:  # the core died before its death reached us
                for request_id in request_ids:
                    self._release(request_id, index)
                raise self._translate(error) from None
        added.add_done_callback(partial(self._on_added, request_ids, index))
        return added

    def _on_added(self, request_ids: list[str], index: int, added: Future[None]) -> None:
        if added.exception() is None:
            return
        with self._lock:  # rejected (ValueError) or the engine died: nothing of it runs
            for request_id in request_ids:
                self._release(request_id, index)

    def abort_requests(self, request_ids: list[str]) -> Future[None]:
        """Abort each request on its core (ids not live are ignored); no ids: a no-op on every core, which
        completes once each has applied everything sent before."""
        with self._lock:
            self._check_alive()
            if not request_ids:
                return self._broadcast(lambda client: client.abort_requests([]), _none)
            by_core: dict[int, list[str]] = {}
            for request_id in request_ids:
                index = self._owner.get(request_id)
                if index is not None:
                    by_core.setdefault(index, []).append(request_id)
                    self._release(request_id)
            futures = [
                self._clients[index].abort_requests(ids) for index, ids in sorted(by_core.items())
            ]
        return gather(futures, _none, self._translate)

    def close_session(self, request_id: str) -> Future[bool]:
        with self._lock:
            self._check_alive()
            index = self._owner.get(request_id, 0)
            closed = self._clients[index].close_session(request_id)

        def forget_if_closed(done: Future[bool]) -> None:
            if done.exception() is None and done.result():
                with self._lock:
                    self._release(request_id, index)

        closed.add_done_callback(forget_if_closed)
        return closed

    # ------------------------------------------------------------------------------------------------ broadcasts
    def call_utility(self, method: str, *args: Any) -> Future[list[Any]]:
        """`EngineCore.<method>(*args)` on every core; the Future holds their results in core order."""
        return self._broadcast(lambda client: client.call_utility(method, *args), list)

    def pause_generation(self, mode: str, clear_cache: bool) -> Future[None]:
        """Pause every core; completes once the pause is in effect on all of them."""
        return self._broadcast(lambda client: client.pause_generation(mode, clear_cache), _none)

    def resume_generation(self) -> Future[None]:
        return self._broadcast(lambda client: client.resume_generation(), _none)

    def is_paused(self) -> Future[bool]:
        """True when every core is paused."""
        return self._broadcast(lambda client: client.is_paused(), all)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Future[bool]:
        """True when every core reset its prefix cache."""
        return self._broadcast(
            lambda client: client.reset_prefix_cache(reset_running_requests), all
        )

    def update_weights(self, weights: Any) -> Future[int]:
        """Reload the weights on every core; the new weight version (the cores count versions alike)."""
        return self._broadcast(lambda client: client.update_weights(weights), _same_version)

    def add_lora(self, lora_request: LoRARequest) -> Future[bool]:
        """Load the adapter on every core (any core may run its requests)."""
        return self._broadcast(lambda client: client.add_lora(lora_request), all)

    def remove_lora(self, lora_int_id: int) -> Future[bool]:
        """True when some core held the adapter."""
        return self._broadcast(lambda client: client.remove_lora(lora_int_id), any)

    def pin_lora(self, lora_int_id: int) -> Future[bool]:
        return self._broadcast(lambda client: client.pin_lora(lora_int_id), all)

    def list_loras(self) -> Future[set[int]]:
        """The adapters every core holds loaded."""
        return self._broadcast(
            lambda client: client.list_loras(), lambda per_core: set.intersection(*per_core)
        )

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Future[list[Any]]:
        """Every rank of every core; results in core order, then rank order within a core."""
        return self._broadcast(
            lambda client: client.collective_rpc(method, args, kwargs),
            lambda per_core: [result for results in per_core for result in results],
        )

    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        raise ValueError(
            f"there are {len(self._clients)} data-parallel engine cores: run a function on each with run_each "
            "(AsyncLLM.run_in_each_engine), which returns their results in core order"
        )

    def run_each(self, fn: Callable[[EngineCore], _T]) -> Future[list[_T]]:
        return self._broadcast(lambda client: client.run(fn), list)

    def _broadcast(
        self, call: Callable[[MPEngineCoreClient], Future[Any]], combine: Callable[[list[Any]], Any]
    ) -> Future[Any]:
        with self._lock:
            self._check_alive()
            try:
                futures = [call(client) for client in self._clients]
            except EngineDeadError as error:
                raise self._translate(error) from None
        return gather(futures, combine, self._translate)

    # ------------------------------------------------------------------------------------------------ outputs
    def _handle_outputs(
        self, index: int, outputs: list[EngineCoreOutput], stats: SchedulerStats
    ) -> None:
        """Core `index`'s output thread: forget finished requests, then the front end's handler (one at a time)."""
        stats.engine_index = index
        with self._handler_lock:
            finished = [output.request_id for output in outputs if output.finished]
            if finished:
                with self._lock:
                    for request_id in finished:
                        self._release(request_id, index)
            self._output_handler(outputs, stats)

    # ------------------------------------------------------------------------------------------------ death
    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._death.error

    def is_alive(self) -> bool:
        """Whether every engine-core process runs."""
        return all(client.is_alive() for client in self._clients)

    def _check_alive(self) -> None:
        self._death.raise_if_dead()

    def _translate(self, error: BaseException) -> BaseException:
        """A core's `EngineDeadError` becomes the engine's (which names the core that died first)."""
        dead_error = self._death.error
        if isinstance(error, EngineDeadError) and dead_error is not None:
            return fresh_dead_error(dead_error)
        return error

    def _on_core_dead(self, index: int, error: EngineDeadError) -> None:
        """Core `index` stopped: unless we are shutting down, the engine dies of it and the other cores stop."""
        with self._lock:
            if not self._death.is_dead:
                dead = EngineDeadError(
                    f"data-parallel engine core {index} of {len(self._load)}: {error}"
                )
                dead.__cause__ = error.__cause__ or RuntimeError(
                    f"engine core {index} stopped unasked"
                )
                self._death.publish_locked(dead)
                self._stopper = threading.Thread(
                    target=self._stop_cores, name="kvflow-dp-stop", daemon=True
                )
                self._stopper.start()
        self._death.report()

    def _forget_all_then(self, dead_handler: DeadHandler) -> DeadHandler:
        """The dead handler: forget every live request (a dead engine owns none), then the front end's."""

        def on_dead(error: EngineDeadError) -> None:
            with self._lock:
                self._owner.clear()
                self._load = [0] * len(self._load)
            dead_handler(error)

        return on_dead

    def _stop_cores(self) -> None:
        """Shut every core down at once; returns when all processes are gone."""
        clients = getattr(self, "_clients", [])
        threads = [
            threading.Thread(target=client.shutdown, name=f"kvflow-dp-stop-{index}", daemon=True)
            for index, client in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def shutdown(self) -> None:
        """Stop every core (idempotent; returns once every engine-core process is gone). Calls still pending fail
        with EngineDeadError."""
        with self._lock:
            self._death.publish_locked()
            stopper = self._stopper
        if stopper is not None and stopper is not threading.current_thread():
            stopper.join()
        self._stop_cores()  # each client's shutdown is idempotent and waits for its process
        self._death.report()


def _none(_: list[Any]) -> None:
    return None


def _same_version(versions: list[int]) -> int:
    if len(set(versions)) != 1:
        raise RuntimeError(f"the engine cores disagree on the weight version: {versions}")
    return versions[0]
