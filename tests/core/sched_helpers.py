"""Helpers for scheduler scenario tests: drive a real Scheduler by hand, step by step.

* `runner_output` / `step` / `run_to_completion`: the synchronous loop `schedule()` -> `ModelRunnerOutput` ->
  `update_from_output()`. By default the sampled token is the hash model's next token after the scheduler's own
  view of the request (`reference_tokens(all tokens so far, 1)[0]`); a `token_fn(request) -> int` overrides it.
* `SimWorker`: a pure-Python worker for either runner protocol. It keeps its own token list, block table and a
  paged "KV cache" (one token per slot) per request, applies each `SchedulerOutput` the way the runner does, writes
  the scheduled tokens through the block table and samples `next_token(tokens read back through the block table)`.
  It appends its own sampled token at once (as the real worker does), so it also models async scheduling, and a
  wrong block, prefix hit, token list or chunk sent by the scheduler changes its output.
* `AsyncDriver`: pipelines `schedule()` ahead of `update_from_output()` with `SimWorker` executing in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvflow.core.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvflow.core.sched.scheduler import Scheduler
from kvflow.request import Request
from kvflow.testing.hash_model import next_token, reference_tokens
from kvflow.testing.worker_slots import WorkerSlots
from kvflow.utils import cdiv

TokenFn = Callable[[Request], int]


def reference_next_token(request: Request) -> int:
    """The hash model's next token after everything the scheduler knows of the request."""
    return reference_tokens(list(request.all_token_ids), 1)[0]


def check_step_invariants(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What must hold for every `SchedulerOutput`, whatever the scenario."""
    total = sum(output.num_scheduled_tokens.values())
    assert output.total_num_scheduled_tokens == total
    assert total <= scheduler.max_num_scheduled_tokens
    assert all(num_tokens > 0 for num_tokens in output.num_scheduled_tokens.values()), (
        output.num_scheduled_tokens
    )
    assert len(scheduler.running) <= scheduler.max_num_running_reqs
    cached = output.scheduled_cached_reqs
    num_reqs = len(cached.req_ids)
    assert (
        len(cached.new_token_ids),
        len(cached.new_block_ids),
        len(cached.num_computed_tokens),
        len(cached.num_output_tokens),
    ) == (num_reqs,) * 4
    new_ids = [new_req.req_id for new_req in output.scheduled_new_reqs]
    assert sorted(new_ids + cached.req_ids) == sorted(output.num_scheduled_tokens)
    if scheduler.use_v2_model_runner:
        assert cached.all_token_ids == {}
        assert not cached.resumed_req_ids


def runner_output(
    scheduler: Scheduler, output: SchedulerOutput, token_fn: TokenFn | None = None
) -> ModelRunnerOutput:
    """One sampled token for each request that reached the end of its known tokens this step, [] otherwise.

    Call right after `schedule()`: `request.num_computed_tokens` is already advanced by the scheduled count.
    """
    token_fn = token_fn or reference_next_token
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        if request is None or request.num_computed_tokens < request.num_tokens:
            sampled.append([])  # a partial prefill (or aborted since): nothing sampled
        else:
            sampled.append([token_fn(request)])
    return ModelRunnerOutput(req_ids, {req_id: i for i, req_id in enumerate(req_ids)}, sampled)


def step(
    scheduler: Scheduler,
    token_fn: TokenFn | None = None,
    slots: WorkerSlots | None = None,
    worker: SimWorker | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """schedule() -> model output -> update_from_output(); returns the SchedulerOutput and the engine outputs."""
    output = scheduler.schedule()
    check_step_invariants(scheduler, output)
    if slots is not None:
        slots.apply(output)
    if worker is not None:
        assert token_fn is None, "the worker samples its own tokens"
        model_output = worker.execute(output)
    else:
        model_output = runner_output(scheduler, output, token_fn)
    return output, scheduler.update_from_output(output, model_output)


def run_to_completion(
    scheduler: Scheduler,
    token_fn: TokenFn | None = None,
    slots: WorkerSlots | None = None,
    worker: SimWorker | None = None,
    max_steps: int = 10_000,
    on_step: Callable[[SchedulerOutput, list[EngineCoreOutput]], None] | None = None,
) -> dict[str, list[int]]:
    """Step until no request has work left; returns the tokens each request produced (in order)."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        output, engine_outputs = step(scheduler, token_fn, slots, worker)
        for engine_output in engine_outputs:
            tokens.setdefault(engine_output.request_id, []).extend(engine_output.new_token_ids)
        if on_step is not None:
            on_step(output, engine_outputs)
    raise AssertionError(f"not done after {max_steps} steps: {scheduler.requests}")


class SimWorker:
    """A worker for either runner protocol, sampling from tokens read back through the block table."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        use_v2_model_runner: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.use_v2_model_runner = use_v2_model_runner
        self.max_model_len = max_model_len
        self.kv: list[int | None] = [None] * (block_size * num_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.block_table: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.parked: dict[
            str, list[int]
        ] = {}  # persistent-batch protocol: preempted requests keep their tokens
        self.num_steps = 0

    @classmethod
    def for_scheduler(cls, scheduler: Scheduler) -> SimWorker:
        return cls(
            scheduler.block_size,
            scheduler.kv_cache_manager.num_blocks,
            scheduler.use_v2_model_runner,
            scheduler.max_model_len,
        )

    def _drop(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)
        self.block_table.pop(req_id, None)
        self.computed.pop(req_id, None)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for req_id in output.finished_req_ids:
            self._drop(req_id)
            self.parked.pop(req_id, None)
        for req_id in output.preempted_req_ids - output.finished_req_ids:
            if not self.use_v2_model_runner and req_id in self.tokens:
                self.parked[req_id] = self.tokens[req_id]
            self._drop(req_id)
        for new_req in output.scheduled_new_reqs:
            self.parked.pop(new_req.req_id, None)
            token_ids = (
                new_req.prefill_token_ids
                if new_req.prefill_token_ids is not None
                else new_req.prompt_token_ids
            )
            self.tokens[new_req.req_id] = list(token_ids)
            self.block_table[new_req.req_id] = list(new_req.block_ids[0])
            self.computed[new_req.req_id] = new_req.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            num_computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                assert not self.use_v2_model_runner
                assert cached.new_block_ids[i] is not None, (
                    f"resumed {req_id!r} without a block table"
                )
                if req_id in self.parked:
                    self.tokens[req_id] = self.parked.pop(req_id)
                self.block_table[req_id] = list(cached.new_block_ids[i][0])
            else:
                assert req_id not in self.parked, (
                    f"parked {req_id!r} scheduled without being resumed"
                )
                assert req_id in self.tokens, f"cached request {req_id!r} unknown to the worker"
                if cached.new_block_ids[i] is not None:
                    self.block_table[req_id].extend(cached.new_block_ids[i][0])
            if req_id in cached.all_token_ids:
                self.tokens[req_id] = list(cached.all_token_ids[req_id])
            elif cached.new_token_ids[i]:
                self.tokens[req_id] = self.tokens[req_id][:num_computed] + list(
                    cached.new_token_ids[i]
                )
            self.computed[req_id] = num_computed

        # Write every scheduled token first, then sample (as the hash model does).
        seq_lens: dict[str, int] = {}
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            start = self.computed[req_id]
            end = start + num_tokens
            tokens = self.tokens[req_id]
            assert end <= len(tokens), (
                f"{req_id!r}: scheduled past the worker's known tokens ({end} > {len(tokens)})"
            )
            table = self.block_table[req_id]
            assert cdiv(end, self.block_size) <= len(table), (
                f"{req_id!r}: scheduled tokens without KV blocks"
            )
            for position in range(start, end):
                self.kv[self._slot(table, position)] = tokens[position]
            self.computed[req_id] = end
            seq_lens[req_id] = end
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            seq_len = seq_lens[req_id]
            tokens = self.tokens[req_id]
            if seq_len < len(tokens):
                sampled.append([])
                continue
            table = self.block_table[req_id]
            read_back = [self.kv[self._slot(table, position)] for position in range(seq_len)]
            assert None not in read_back, f"{req_id!r}: read a KV slot that was never written"
            token_id = next_token(read_back)  # type: ignore[arg-type]
            if self.max_model_len is None or len(tokens) < self.max_model_len:
                tokens.append(token_id)
            sampled.append([token_id])
        return ModelRunnerOutput(req_ids, {req_id: i for i, req_id in enumerate(req_ids)}, sampled)

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size


class AsyncDriver:
    """Schedules ahead of updates: `schedule()` plans a step and the worker runs it at once (in order);
    `update()` delivers the oldest step's output to the scheduler."""

    def __init__(self, scheduler: Scheduler, slots: WorkerSlots | None = None) -> None:
        self.scheduler = scheduler
        self.worker = SimWorker.for_scheduler(scheduler)
        self.slots = slots
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str | None] = {}
        self.outputs: list[SchedulerOutput] = []

    def schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        check_step_invariants(self.scheduler, output)
        if self.slots is not None:
            self.slots.apply(output)
        self.outputs.append(output)
        self.in_flight.append((output, self.worker.execute(output)))
        self.check_placeholders()
        return output

    def update(self) -> list[EngineCoreOutput]:
        output, model_output = self.in_flight.popleft()
        engine_outputs = self.scheduler.update_from_output(output, model_output)
        for engine_output in engine_outputs:
            self.tokens.setdefault(engine_output.request_id, []).extend(engine_output.new_token_ids)
            if engine_output.finish_reason is not None:
                self.finish_reasons[engine_output.request_id] = engine_output.finish_reason
        self.check_placeholders()
        return engine_outputs

    def check_placeholders(self) -> None:
        for request in self.scheduler.requests.values():
            assert request.num_output_placeholders >= 0, request
            assert request.async_tokens_to_discard >= 0, request

    def run(self, depth: int = 2, max_steps: int = 10_000) -> dict[str, list[int]]:
        """Keep `depth` steps in flight until everything is done and delivered."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and not self.in_flight:
                return self.tokens
            if self.scheduler.has_unfinished_requests():
                self.schedule()
            while self.in_flight and (
                len(self.in_flight) >= depth or not self.scheduler.has_unfinished_requests()
            ):
                self.update()
        raise AssertionError(f"not done after {max_steps} steps: {self.scheduler.requests}")
