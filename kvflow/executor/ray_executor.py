"""RayExecutor (`ray`): one Ray actor per tensor-parallel rank, placed by a placement group.

The executor runs in the engine-core process (the Ray driver, or a client of the cluster the driver joined): it
reserves one bundle per rank (`{"CPU": n}` on CPU, `{"GPU": 1}` on CUDA; strategy PACK, so ranks share a node when
they fit and spread over the cluster's nodes when not), starts one `RayRankWorker` actor in each bundle, and has
rank 0 pick its node's address and a free port for the torch.distributed rendezvous, so the same code runs on a
local Ray instance and on a multi-node cluster. Each call is `ray.put` once and the one object reference is passed
to every actor (Ray resolves it from the object store: one serialization, not N); calls to an actor run in
submission order. A rank whose actor dies or whose step raises fails the step's Future with an error naming the
rank; `shutdown()` kills every actor and removes the placement group (and stops Ray if this executor started it).

Ray is the optional extra `kvflow[ray]`; without it this backend raises ImportError saying how to install it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from kvflow.executor.broadcast import BroadcastExecutor, WorkerDeath
from kvflow.executor.messages import RankStartup, WorkerReply
from kvflow.executor.multiproc import available_cpus, free_tcp_port

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import ModelRunnerOutput
    from kvflow.executor.messages import ExecuteModel, RunMethod, SampleTokens, WorkerReady
    from kvflow.model_info import ModelInfo
    from kvflow.worker.worker import Worker

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = "pip install 'kvflow[ray]'"
_PLACEMENT_TIMEOUT_S = 120.0


def import_ray() -> Any:
    """The `ray` module, or an ImportError that says how to install the extra."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            f"distributed_executor_backend='ray' needs Ray, which is not installed: {RAY_INSTALL_HINT}"
        ) from error
    return ray


class RayRankWorker:
    """The body of one rank's actor: builds the rank's `Worker` on `start` and runs broadcast messages."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def rendezvous_address(self) -> str:
        """`tcp://<this node's address>:<a free port>` for the rank-0 torch.distributed store."""
        import ray

        node_address = ray.util.get_node_ip_address()
        return f"tcp://{node_address}:{free_tcp_port(node_address)}"

    def start(self, startup: RankStartup) -> WorkerReady | WorkerReply:
        from kvflow.executor.messages import STARTUP_CALL_ID, RemoteFailure
        from kvflow.executor.rank_worker import build_rank_worker, ready_message

        try:
            self.worker = build_rank_worker(startup)
        except Exception as error:
            failure = RemoteFailure.from_exception(error)
            return WorkerReply(startup.rank, STARTUP_CALL_ID, failure=failure)
        return ready_message(self.worker)

    def run(
        self, call_id: int, message: ExecuteModel | SampleTokens | RunMethod
    ) -> WorkerReply | None:
        from kvflow.executor.rank_worker import handle_message

        assert self.worker is not None, "start() first"
        return handle_message(self.worker, call_id, message)


class RayExecutor(BroadcastExecutor):
    """Drives one `RayRankWorker` actor per rank (see the module docstring).

    Invariants: `actors[r]` is rank r's actor in bundle r of `placement_group`; every call reaches every actor in
    the order calls were made; once a rank has died every later call raises the error naming it."""

    name = "ray"

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        from kvflow.utils import resolve_device

        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        self.world_size = engine_config.parallel_config.tensor_parallel_size
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self.death = WorkerDeath(self._lock)
        self._stopped = False
        self.actors: list[Any] = []
        self.placement_group: Any = None
        device_type = resolve_device(engine_config.model_config.device).type
        if device_type == "cuda":
            bundle: dict[str, float] = {"GPU": 1, "CPU": 1}
            num_threads = 0
        else:
            cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
            cpus_per_rank = max(1, min(cluster_cpus, available_cpus()) // self.world_size)
            bundle = {"CPU": cpus_per_rank}
            num_threads = cpus_per_rank
        self.placement_group = placement_group([bundle] * self.world_size, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
            actor_class = ray.remote(RayRankWorker)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank
                )
                self.actors.append(
                    actor_class.options(
                        num_cpus=bundle["CPU"],
                        num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=strategy,
                    ).remote()
                )
            dist_init_method = ray.get(self.actors[0].rendezvous_address.remote())
            startups = RankStartup.for_every_rank(
                engine_config, model_info, self.world_size, dist_init_method, num_threads
            )
            answers = ray.get(
                [
                    actor.start.remote(startup)
                    for actor, startup in zip(self.actors, startups, strict=True)
                ]
            )
        except BaseException:
            self.shutdown()
            raise
        failures = [answer for answer in answers if isinstance(answer, WorkerReply)]
        if failures:
            self.shutdown()
            first = min(failures, key=lambda answer: answer.rank)
            assert first.failure is not None
            raise first.failure.to_exception(first.rank)
        self.num_kv_blocks = min(answer.num_kv_blocks for answer in answers)
        logger.info(
            "ray executor: %d ranks (actor pids %s) over %s, %d KV blocks",
            self.world_size,
            ", ".join(str(answer.pid) for answer in answers),
            dist_init_method,
            self.num_kv_blocks,
        )

    # ------------------------------------------------------------------------------------------------ calls
    def _step(
        self, message: ExecuteModel | SampleTokens, non_block: bool
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        refs = self._submit(message)
        future: Future[ModelRunnerOutput] = Future()
        for rank, ref in enumerate(refs):
            ref.future().add_done_callback(partial(self._on_step_answer, future, rank))
        return future if non_block else future.result()

    def _on_step_answer(self, future: Future[ModelRunnerOutput], rank: int, done: Future) -> None:
        """Rank 0's answer completes the step; any rank's death or failure fails it (and the executor)."""
        try:
            reply: WorkerReply | None = done.result()
        except Exception as error:
            self._set_dead(f"tensor-parallel rank {rank} (Ray actor) died or failed: {error}")
            self._settle(future, error=self.death.error)
            return
        if reply is not None and reply.failure is not None:
            self._set_dead(
                f"tensor-parallel rank {rank} failed during a step: {reply.failure.description}"
            )
            self._settle(future, error=self.death.error)
        elif rank == 0:
            assert reply is not None
            self._settle(future, result=reply.result)

    def _run_method(self, message: RunMethod) -> list[Any]:
        refs = self._submit(message)
        replies: list[WorkerReply] = []
        for rank, ref in enumerate(refs):
            try:
                replies.append(self._ray.get(ref))
            except Exception as error:
                self._set_dead(f"tensor-parallel rank {rank} (Ray actor) died or failed: {error}")
                assert self.death.error is not None
                raise self.death.error from error
        for reply in replies:
            if reply.failure is not None:
                raise reply.failure.to_exception(reply.rank)
        return [reply.result for reply in replies]

    def _submit(self, message: ExecuteModel | SampleTokens | RunMethod) -> list[Any]:
        """Put `message` in the object store once and hand the one reference to every actor."""
        with self._lock:
            self.death.raise_if_dead_locked()
            if self._stopped:
                raise RuntimeError("the ray executor is shut down")
            call_id = next(self._call_ids)
            payload = self._ray.put(message)
            return [actor.run.remote(call_id, payload) for actor in self.actors]

    def _set_dead(self, message: str) -> None:
        self.death.publish(message + ": the engine cannot continue")

    def _settle(
        self,
        future: Future[Any],
        result: Any = None,
        error: BaseException | None = None,
    ) -> None:
        with self._lock:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    # ------------------------------------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Kill every actor, remove the placement group, and stop Ray if this executor started it."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                logger.debug("could not kill a rank's actor", exc_info=True)
        try:
            if self.placement_group is not None:
                self._remove_placement_group(self.placement_group)
        except Exception:
            logger.debug("could not remove the placement group", exc_info=True)
        if self._owns_ray:
            self._ray.shutdown()
