"""Randomized scheduler runs mixing plain requests, streaming sessions, aborts and resets, checked against the
hash-model reference after every chunk, with the slot model (or the persistent-batch worker) applied every step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from sched_helpers import AsyncDriver, SimWorker, check_step_invariants

from kvflow.core.sched.output import EngineCoreOutput
from kvflow.request import RequestStatus
from kvflow.testing import make_request, make_scheduler
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.worker_slots import WorkerSlots

MAX_MODEL_LEN = 40


@dataclass
class Tracked:
    history: list[int]  # tokens the current chunk's generation starts from
    produced: list[int] = field(default_factory=list)
    resumable: bool = False
    idle: bool = False
    pending: list[list[int] | None] = field(default_factory=list)  # queued chunks (None: close)


class Harness:
    def __init__(self, seed: int, async_scheduling: bool, use_v2_model_runner: bool) -> None:
        self.rng = random.Random(seed)
        self.max_num_seqs = self.rng.choice([2, 3, 4])
        self.scheduler = make_scheduler(
            block_size=4,
            num_blocks=48,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.rng.choice([8, 16, 40]),
            max_model_len=MAX_MODEL_LEN,
            policy=self.rng.choice(["fcfs", "priority"]),
            async_scheduling=async_scheduling,
            use_v2_model_runner=use_v2_model_runner,
        )
        slots = WorkerSlots(self.max_num_seqs) if use_v2_model_runner else None
        self.driver = AsyncDriver(self.scheduler, slots)
        self.depth = self.rng.choice([2, 3]) if async_scheduling else 1
        self.tracked: dict[str, Tracked] = {}
        self.next_id = 0
        self.num_chunks_checked = 0

    # ---------------------------------------------------------------------------------------------- actions
    def add_request(self) -> None:
        req_id = f"r{self.next_id}"
        self.next_id += 1
        resumable = self.rng.random() < 0.4
        prompt = [self.rng.randrange(60) for _ in range(self.rng.randint(1, 12))]
        self.scheduler.add_request(
            make_request(
                req_id,
                prompt,
                max_tokens=self.rng.randint(1, 6),
                priority=self.rng.randrange(3),
                resumable=resumable,
            )
        )
        self.tracked[req_id] = Tracked(list(prompt), resumable=resumable)

    def feed_session(self) -> None:
        sessions = [
            req_id
            for req_id, t in self.tracked.items()
            if t.resumable and not (t.pending and t.pending[-1] is None)
        ]
        if not sessions:
            return
        req_id = self.rng.choice(sessions)
        tracked = self.tracked[req_id]
        close = self.rng.random() < 0.2
        chunk = (
            []
            if close and self.rng.random() < 0.5
            else [self.rng.randrange(60) for _ in range(self.rng.randint(1, 6))]
        )
        request = make_request(
            req_id, chunk, max_tokens=self.rng.randint(1, 5), resumable=not close
        )
        if tracked.idle:
            if chunk and len(tracked.history) + len(chunk) > MAX_MODEL_LEN:
                with pytest.raises(ValueError):
                    self.scheduler.add_request(request)
                return
            self.scheduler.add_request(request)
            if not chunk:
                del self.tracked[req_id]  # closed
                return
            tracked.history = tracked.history + chunk
            tracked.idle = False
            if close:
                tracked.pending.append(None)
        else:
            self.scheduler.add_request(request)
            if chunk:
                tracked.pending.append(chunk)
            if close:
                tracked.pending.append(None)

    def abort(self) -> None:
        if self.tracked:
            req_id = self.rng.choice(sorted(self.tracked))
            self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            del self.tracked[req_id]

    # ---------------------------------------------------------------------------------------------- checking
    def on_output(self, output: EngineCoreOutput) -> None:
        tracked = self.tracked.get(output.request_id)
        assert tracked is not None, f"output for untracked request {output.request_id}"
        tracked.produced.extend(output.new_token_ids)
        if output.finish_reason is None:
            return
        assert output.finish_reason == "length"
        assert tracked.produced, output
        assert tracked.produced == reference_tokens(tracked.history, len(tracked.produced)), (
            output.request_id
        )
        self.num_chunks_checked += 1
        kept = tracked.history + tracked.produced[:-1]
        tracked.produced = []
        if not output.session_continues:
            assert (
                not tracked.resumable
                or (tracked.pending and tracked.pending[0] is None)
                or (tracked.pending and len(kept) + len(tracked.pending[0]) > MAX_MODEL_LEN)
            )
            del self.tracked[output.request_id]
            return
        assert tracked.resumable
        if tracked.pending:
            tracked.history = kept + tracked.pending.pop(0)
        else:
            tracked.history = kept
            tracked.idle = True

    def update(self) -> None:
        for output in self.driver.update():
            self.on_output(output)

    def check_scheduler_state(self) -> None:
        scheduler = self.scheduler
        idle = [req_id for req_id, t in self.tracked.items() if t.idle]
        assert scheduler.num_waiting_for_streaming_input == len(idle)
        for req_id in idle:
            assert scheduler.requests[req_id].status == RequestStatus.WAITING_FOR_STREAMING_REQ
        assert set(scheduler.requests) == set(self.tracked)
        # A request outside `running` holds KV blocks only as a session that kept its slot between chunks.
        running = set(map(id, scheduler.running))
        holding_outside_running = [
            request
            for request in scheduler.requests.values()
            if id(request) not in running
            and scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        ]
        assert all(request.resumable for request in holding_outside_running)
        assert scheduler.num_slot_holders == len(scheduler.running) + len(holding_outside_running)
        assert scheduler.get_num_unfinished_requests() == len(scheduler.running) + len(
            scheduler.waiting
        )

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            roll = self.rng.random()
            if roll < 0.3:
                self.add_request()
            elif roll < 0.5:
                self.feed_session()
            elif roll < 0.55:
                self.abort()
            elif roll < 0.6:
                assert self.scheduler.reset_prefix_cache(reset_running_requests=True) is True
            self.step_once()
        # Drain: close every session (feed_session closes them with same-id requests), then run until nothing
        # is left.
        for req_id, tracked in list(self.tracked.items()):
            if tracked.resumable:
                assert self.scheduler.close_session(req_id) is tracked.idle
                if tracked.idle:
                    del self.tracked[req_id]
                else:
                    tracked.pending.append(None)
        for _ in range(2000):
            if not self.scheduler.has_unfinished_requests() and not self.driver.in_flight:
                break
            self.step_once()
        assert self.tracked == {}
        assert self.scheduler.requests == {}
        assert self.scheduler.kv_cache_manager.usage == 0.0

    def step_once(self) -> None:
        output = self.driver.schedule()
        check_step_invariants(self.scheduler, output)
        while self.driver.in_flight and (
            len(self.driver.in_flight) >= self.depth or self.rng.random() < 0.2
        ):
            self.update()
        self.check_scheduler_state()


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_randomized_mixed_traffic(seed, async_scheduling, use_v2_model_runner):
    harness = Harness(seed, async_scheduling, use_v2_model_runner)
    harness.run(150)
    assert harness.num_chunks_checked > 10


def test_sim_worker_matches_reference_for_simple_run():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    worker = SimWorker.for_scheduler(scheduler)
    tokens = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        for engine_output in scheduler.update_from_output(output, worker.execute(output)):
            tokens.extend(engine_output.new_token_ids)
    assert tokens == reference_tokens([1, 2, 3], 4)
