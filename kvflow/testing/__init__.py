"""Test doubles and helpers: the hash model re-exported (an oracle model run by the real runner; it lives in
`kvflow.models.hash_model`), the worker slot model, and factories for schedulers and requests used by tests and the
randomized simulations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.models.hash_model import DEFAULT_EOS_TOKEN_ID

if TYPE_CHECKING:
    from kvflow.core.sched.scheduler import Scheduler
    from kvflow.request import Request

__all__ = ["DEFAULT_EOS_TOKEN_ID", "make_request", "make_requests", "make_scheduler"]


def make_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    block_size: int = 16,
    num_blocks: int = 10000,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    async_scheduling: bool = False,
    use_v2_model_runner: bool = True,
    max_loras: int = 0,
) -> Scheduler:
    """A scheduler with no model behind it. `max_model_len=None` means `max_num_batched_tokens`; `max_loras > 0`
    admits requests with adapters (`LoRARequest`) under that many distinct running adapters."""
    from kvflow.config import CacheConfig, SchedulerConfig
    from kvflow.core.sched.async_scheduler import AsyncScheduler
    from kvflow.core.sched.scheduler import Scheduler

    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len if max_model_len is not None else max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,  # type: ignore[arg-type]
        async_scheduling=async_scheduling,
        use_v2_model_runner=use_v2_model_runner,
    )
    cache_config = CacheConfig(
        block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
    )
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_cls(scheduler_config, cache_config, max_loras=max_loras)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 16,
    min_tokens: int = 0,
    priority: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    resumable: bool = False,
    eos_token_id: int | None = DEFAULT_EOS_TOKEN_ID,
) -> Request:
    """One greedy request (the scheduler attaches block hashing when the request is added)."""
    from kvflow.request import Request
    from kvflow.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
    )
    return Request(
        request_id,
        prompt_token_ids,
        params,
        eos_token_id=eos_token_id,
        priority=priority,
        resumable=resumable,
    )


def make_requests(
    num_requests: int, num_tokens: int = 10, max_tokens: int = 16, ignore_eos: bool = False
) -> list[Request]:
    """Requests "0", "1", ... whose prompt is `[i] * num_tokens`."""
    return [
        make_request(str(i), [i] * num_tokens, max_tokens=max_tokens, ignore_eos=ignore_eos)
        for i in range(num_requests)
    ]
