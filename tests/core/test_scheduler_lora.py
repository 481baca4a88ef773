"""The scheduler with LoRA adapters: at most `max_loras` distinct adapters among the running requests (so never more
in a step than the worker has slots), a request waiting for an adapter slot is not overtaken by later adapter
requests (base-model requests still pass), prefix-cache blocks never cross adapters, and the adapter counts in the
stats."""

from __future__ import annotations

import random

from sched_helpers import AsyncDriver, SimWorker, run_to_completion, step

from kvflow.core.sched.output import SchedulerOutput
from kvflow.core.sched.scheduler import Scheduler
from kvflow.lora.request import LoRARequest
from kvflow.request import Request
from kvflow.testing import make_request, make_scheduler
from kvflow.testing.hash_model import reference_tokens

ADAPTERS = {
    adapter_id: LoRARequest(f"adapter-{adapter_id}", adapter_id, f"/adapters/{adapter_id}")
    for adapter_id in range(1, 6)
}


def lora_request(request_id: str, prompt: list[int], adapter_id: int, **options) -> Request:
    """A greedy request run with adapter `adapter_id` (0: the base model)."""
    request = make_request(request_id, prompt, **options)
    request.lora_request = ADAPTERS[adapter_id] if adapter_id else None
    return request


def running_adapters(scheduler: Scheduler) -> set[int]:
    return {
        request.lora_request.lora_int_id
        for request in scheduler.running
        if request.lora_request is not None
    }


def step_adapters(scheduler: Scheduler, output: SchedulerOutput) -> set[int]:
    """The adapters of the requests a step runs."""
    adapters = set()
    for req_id in output.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        if request is not None and request.lora_request is not None:
            adapters.add(request.lora_request.lora_int_id)
    return adapters


def test_running_adapters_never_exceed_max_loras_and_every_request_completes():
    scheduler = make_scheduler(max_loras=2, max_num_seqs=8)
    worker = SimWorker.for_scheduler(scheduler)
    prompts = {}
    for index in range(12):
        prompt = [100 + index] * (5 + index)
        prompts[str(index)] = prompt
        scheduler.add_request(
            lora_request(str(index), prompt, adapter_id=index % 4, max_tokens=6, ignore_eos=True)
        )

    def check(output, _outputs):
        assert len(running_adapters(scheduler)) <= 2
        assert len(step_adapters(scheduler, output)) <= 2
        for new_req in output.scheduled_new_reqs:  # the adapter travels with the new request, once
            assert new_req.lora_request == scheduler.requests[new_req.req_id].lora_request

    tokens = run_to_completion(scheduler, worker=worker, on_step=check)
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference_tokens(prompt, 6)


def test_a_request_waiting_for_an_adapter_slot_is_not_overtaken_by_later_adapter_requests():
    scheduler = make_scheduler(max_loras=1)
    scheduler.add_request(lora_request("a1", [1] * 8, adapter_id=1, max_tokens=4, ignore_eos=True))
    scheduler.add_request(lora_request("b", [2] * 8, adapter_id=2, max_tokens=4, ignore_eos=True))
    scheduler.add_request(lora_request("a2", [3] * 8, adapter_id=1, max_tokens=4, ignore_eos=True))
    scheduler.add_request(
        lora_request("base", [4] * 8, adapter_id=0, max_tokens=4, ignore_eos=True)
    )
    output, _ = step(scheduler)
    # a1 takes the one adapter slot; b waits for it; a2 (same adapter as a1, but later than b) waits behind b;
    # the base-model request needs no adapter slot and runs.
    assert set(output.num_scheduled_tokens) == {"a1", "base"}
    admitted_order = []
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        admitted_order += [new_req.req_id for new_req in output.scheduled_new_reqs]
        assert len(running_adapters(scheduler)) <= 1
    assert admitted_order == ["b", "a2"]


def test_prefix_cache_blocks_are_shared_within_an_adapter_and_never_across_adapters():
    scheduler = make_scheduler(max_loras=4)
    prefix = list(range(1000, 1032))  # two full blocks of 16

    def admitted_hit(request_id: str, adapter_id: int) -> int:
        scheduler.add_request(
            lora_request(request_id, [*prefix, 7], adapter_id, max_tokens=1, ignore_eos=True)
        )
        output, _ = step(scheduler)
        [new_req] = [new for new in output.scheduled_new_reqs if new.req_id == request_id]
        while scheduler.has_unfinished_requests():
            step(scheduler)
        return new_req.num_computed_tokens

    assert admitted_hit("first-1", adapter_id=1) == 0
    assert admitted_hit("first-2", adapter_id=2) == 0  # same tokens, another adapter: no hit
    assert admitted_hit("base", adapter_id=0) == 0  # nor for the base model
    assert admitted_hit("again-1", adapter_id=1) == 32  # the same adapter reuses its blocks
    assert admitted_hit("again-base", adapter_id=0) == 32


def test_an_adapter_id_registered_for_another_folder_does_not_reuse_the_first_folders_blocks():
    scheduler = make_scheduler(max_loras=2)
    prompt = [*range(2000, 2032), 5]
    first = make_request("first", prompt, max_tokens=1, ignore_eos=True)
    first.lora_request = LoRARequest("tuned", 1, "/adapters/v1")
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    second = make_request("second", prompt, max_tokens=1, ignore_eos=True)
    second.lora_request = LoRARequest("tuned", 1, "/adapters/v2")
    scheduler.add_request(second)
    output, _ = step(scheduler)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0


def test_stats_count_running_and_waiting_requests_per_adapter():
    scheduler = make_scheduler(max_loras=1)
    for request_id, adapter_id in [("x", 1), ("y", 1), ("z", 2), ("w", 0)]:
        scheduler.add_request(lora_request(request_id, [5] * 4, adapter_id, max_tokens=8))
    step(scheduler)
    stats = scheduler.make_stats()
    assert stats.running_lora_adapters == {"adapter-1": 2}
    assert stats.waiting_lora_adapters == {"adapter-2": 1}
    assert make_scheduler().make_stats().running_lora_adapters == {}


def test_randomized_async_steps_with_preemption_keep_adapter_limit_and_tokens():
    """Async scheduling, a small cache (preemptions), random adapters (and none) arriving over time."""
    for seed in range(6):
        rng = random.Random(seed)
        scheduler = make_scheduler(
            max_loras=2,
            max_num_seqs=6,
            num_blocks=10,
            block_size=4,
            max_num_batched_tokens=24,
            max_model_len=64,
            async_scheduling=True,
        )
        driver = AsyncDriver(scheduler)
        prompts: dict[str, list[int]] = {}
        max_tokens = {}
        for step_index in range(400):
            if len(prompts) < 14 and rng.random() < 0.3:
                request_id = f"r{len(prompts)}"
                prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(2, 12))]
                prompts[request_id] = prompt
                max_tokens[request_id] = rng.randrange(4, 24)
                scheduler.add_request(
                    lora_request(
                        request_id,
                        prompt,
                        adapter_id=rng.randrange(0, 5),
                        max_tokens=max_tokens[request_id],
                        ignore_eos=True,
                    )
                )
            output = driver.schedule()
            assert len(running_adapters(scheduler)) <= 2, f"seed {seed} step {step_index}"
            assert len(step_adapters(scheduler, output)) <= 2, f"seed {seed} step {step_index}"
            driver.update()
            if len(prompts) == 14 and not scheduler.has_unfinished_requests():
                break
        while driver.in_flight:
            driver.update()
        assert not scheduler.has_unfinished_requests(), f"seed {seed}: requests left unfinished"
        for request_id, prompt in prompts.items():
            assert driver.tokens[request_id] == reference_tokens(prompt, max_tokens[request_id]), (
                f"seed {seed} request {request_id}"
            )
