"""WorkerSlots: the slot model must accept what the slot runner accepts and refuse what it refuses."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from kvflow.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import HashModel
from kvflow.testing.worker_slots import WorkerSlots
from kvflow.worker.model_runner import ModelRunner


def output(
    new_ids: Iterable[str] = (),
    cached_ids: Iterable[str] = (),
    scheduled: Iterable[str] = (),
    finished: Iterable[str] = (),
    preempted: Iterable[str] = (),
) -> SchedulerOutput:
    """A plan in which every new request has a 1-token prompt in its own block; each scheduled id runs 1 token."""
    new_reqs = [
        NewRequestData(req_id, [int(req_id)], SamplingParams(), ([int(req_id)],), 0)
        for req_id in new_ids
    ]
    cached_ids = list(cached_ids)
    cached = CachedRequestData(
        req_ids=cached_ids,
        new_token_ids=[[] for _ in cached_ids],
        new_block_ids=[None for _ in cached_ids],
        num_computed_tokens=[1 for _ in cached_ids],
        num_output_tokens=[1 for _ in cached_ids],
    )
    num_scheduled = dict.fromkeys(scheduled, 1)
    return SchedulerOutput(
        new_reqs,
        cached,
        num_scheduled,
        len(num_scheduled),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def test_admits_up_to_capacity_then_refuses() -> None:
    slots = WorkerSlots(2)
    slots.apply(output(new_ids=["1", "2"], scheduled=["1", "2"]))
    assert slots.held == {"1", "2"} and slots.num_free == 0
    with pytest.raises(AssertionError, match="No free indices"):
        slots.apply(output(new_ids=["3"], scheduled=["3"]))


def test_release_happens_before_admission() -> None:
    slots = WorkerSlots(2)
    slots.apply(output(new_ids=["1", "2"]))
    slots.apply(output(new_ids=["3", "4"], finished=["1"], preempted=["2"]))
    assert slots.held == {"3", "4"}


def test_same_id_add_reuses_its_own_slot() -> None:
    slots = WorkerSlots(1)
    slots.apply(output(new_ids=["1"]))
    slots.apply(output(new_ids=["1"], scheduled=["1"]))
    assert slots.held == {"1"} and slots.num_free == 0


def test_unknown_release_is_ignored() -> None:
    slots = WorkerSlots(2)
    slots.apply(output(new_ids=["1"], finished=["9"], preempted=["8"]))
    assert slots.held == {"1"} and slots.num_free == 1


def test_cached_request_must_hold_a_slot() -> None:
    slots = WorkerSlots(2)
    slots.apply(output(new_ids=["1"]))
    with pytest.raises(AssertionError, match="cached request '2'"):
        slots.apply(output(cached_ids=["1", "2"]))
    with pytest.raises(AssertionError, match="cached request '1'"):
        slots.apply(output(cached_ids=["1"], preempted=["1"]))


def test_scheduled_request_must_hold_a_slot() -> None:
    slots = WorkerSlots(2)
    with pytest.raises(AssertionError, match="scheduled request '5'"):
        slots.apply(output(scheduled=["5"]))


@pytest.mark.parametrize("seed", range(10))
def test_agrees_with_the_slot_runner(seed: int) -> None:
    """Random admissions and releases: the model and the runner accept and refuse the same plans."""
    rng = random.Random(seed)
    max_num_reqs = 3
    model = WorkerSlots(max_num_reqs)
    runner = ModelRunner(
        HashModel(), max_num_reqs=max_num_reqs, max_model_len=8, block_size=1, num_blocks=64
    )
    held: set[str] = set()
    num_refused = 0
    for _ in range(60):
        released = {r for r in held if rng.random() < 0.3}
        finished = {r for r in released if rng.random() < 0.5}
        new_ids = rng.sample([str(i) for i in range(8)], rng.randint(0, 2))
        plan = output(
            new_ids=new_ids, finished=finished, preempted=released - finished, scheduled=new_ids
        )
        refusals = []
        for target in (model.apply, runner.execute_model):
            try:
                target(plan)
                refusals.append(None)
            except AssertionError as error:
                refusals.append(str(error))
        assert refusals[0] == refusals[1]
        num_refused += refusals[0] is not None
        assert model.held == set(runner.slots.req_id_to_index)
        assert model.num_free == runner.slots.num_free
        held = model.held.copy()
    assert num_refused > 0
