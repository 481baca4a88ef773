"""One tensor-parallel rank's side of a distributed executor, shared by the `mp` worker processes and the `ray`
actors: join the group, build the `Worker`, and turn each broadcast message into the answer the executor expects."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvflow.executor.messages import (
    ExecuteModel,
    RankStartup,
    RemoteFailure,
    RunMethod,
    SampleTokens,
    WorkerReady,
    WorkerReply,
)

if TYPE_CHECKING:
    from kvflow.worker.worker import Worker

logger = logging.getLogger(__name__)


def build_rank_worker(startup: RankStartup) -> Worker:
    """Set this rank's thread count, join the tensor-parallel group and build its worker (its shard of the model
    and its KV cache)."""
    import torch

    from kvflow.distributed import init_tensor_parallel_group
    from kvflow.utils import resolve_device
    from kvflow.worker.worker import Worker

    if startup.num_threads > 0:
        torch.set_num_threads(startup.num_threads)
    device_type = resolve_device(startup.engine_config.model_config.device).type
    if device_type == "cpu" and startup.dist_init_method.startswith("tcp://127.0.0.1:"):
        # A loopback rendezvous: gloo's pairs stay on the loopback interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device_type == "cuda" and startup.world_size > 1:
        # NCCL binds each rank to its device before the group forms (Ray gives each actor one visible GPU).
        torch.cuda.set_device(startup.rank % torch.cuda.device_count())
    tp = init_tensor_parallel_group(
        startup.rank, startup.world_size, startup.dist_init_method, device_type
    )
    worker = Worker(startup.engine_config, startup.model_info, tp)
    logger.info(
        "tensor-parallel rank %d/%d (pid %d) ready: %d KV blocks, %d threads",
        startup.rank,
        startup.world_size,
        os.getpid(),
        worker.num_kv_blocks,
        torch.get_num_threads(),
    )
    return worker


def ready_message(worker: Worker) -> WorkerReady:
    return WorkerReady(worker.rank, os.getpid(), worker.num_kv_blocks)


def handle_message(
    worker: Worker, call_id: int, message: ExecuteModel | SampleTokens | RunMethod
) -> WorkerReply | None:
    """Run one broadcast message on this rank. Returns the reply to send, or None: only rank 0 answers a step,
    unless the step failed (a failure always answers, so the executor learns which rank broke)."""
    try:
        if isinstance(message, ExecuteModel | SampleTokens):
            if isinstance(message, ExecuteModel):
                output = worker.execute_model(message.scheduler_output)
            else:
                output = worker.sample_tokens(message.grammar_output)
            return WorkerReply(worker.rank, call_id, output) if worker.rank == 0 else None
        result = worker.execute_method(message.method, message.args, message.kwargs)
        return WorkerReply(worker.rank, call_id, result)
    except Exception as error:
        if isinstance(message, ExecuteModel | SampleTokens):
            logger.exception("tensor-parallel rank %d failed in a step", worker.rank)
        return WorkerReply(worker.rank, call_id, failure=RemoteFailure.from_exception(error))
