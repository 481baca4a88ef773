"""Executors run an engine core's workers; each backend is registered by name (`distributed_executor_backend`):

    uni   one worker in the engine's own process (tensor_parallel_size 1; the default there)
    mp    one worker process per tensor-parallel rank on this machine (the default at tensor_parallel_size > 1)
    ray   one Ray actor per rank, placed by a placement group (the optional extra `kvflow[ray]`)

Backends are imported only when built, so `ray` is needed only by the `ray` executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.config import EXECUTOR_BACKENDS
from kvflow.registry import LazyRegistry

if TYPE_CHECKING:
    from kvflow.config import ParallelConfig
    from kvflow.executor.base import Executor

EXECUTORS: LazyRegistry[type[Executor]] = LazyRegistry(
    "distributed_executor_backend",
    {
        "uni": "kvflow.executor.uniproc:UniProcExecutor",
        "mp": "kvflow.executor.multiproc:MultiprocExecutor",
        "ray": "kvflow.executor.ray_executor:RayExecutor",
    },
)
assert EXECUTORS.names() == EXECUTOR_BACKENDS, (
    "config.EXECUTOR_BACKENDS lists the registered backends"
)


def resolve_executor_backend(parallel_config: ParallelConfig) -> str:
    """The backend an engine uses: the one asked for, else "uni" at tensor_parallel_size 1 and "mp" above."""
    if parallel_config.distributed_executor_backend is not None:
        return parallel_config.distributed_executor_backend
    return "uni" if parallel_config.tensor_parallel_size == 1 else "mp"


def get_executor_class(name: str) -> type[Executor]:
    """The executor class registered as `name`; an unknown name is a ValueError listing the known ones."""
    return EXECUTORS.get(name)


__all__ = ["EXECUTORS", "get_executor_class", "resolve_executor_backend"]
