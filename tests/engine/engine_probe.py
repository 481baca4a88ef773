"""The `EngineCore` under test, for `engine_simulation.py` and the deterministic engine tests: the toy grammars and
their constrained reference, `make_engine_core`, greedy requests and their expected tokens, `EngineProbe` (every
`SchedulerOutput` checked as it goes out: slots, histories, the persistent batch) and `EngineDriver` (steps a core
by hand with a probe installed). `tests.engine.engine_simulation` re-exports every name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvflow.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from kvflow.engine.core import EngineCore
from kvflow.models.hash_model import hash_grammar_stop_token_id, next_token
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.spec_proposers import HASH_ORACLE_METHOD, register_hash_oracle
from kvflow.testing.worker_slots import WorkerSlots

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput


PAUSE_MODES = ("abort", "wait", "keep")
# Toy grammars over the hash-logits model's synthetic vocabulary (token i is "a<i>" for even i, "b<i>" for odd
# i): outputs alternate even, odd, even, ... and may end (with the grammar's stop token) after an odd token.
# ALTERNATING may end after any number of pairs; BOUNDED after 1 to 3 pairs, and must end after 3.
ALTERNATING = StructuredOutputsParams(regex=r"(a[0-9]+b[0-9]+)*")
BOUNDED = StructuredOutputsParams(regex=r"(a[0-9]+b[0-9]+){1,3}")
# name -> (constraint, fewest pairs before the end, most pairs or None)
CONSTRAINTS: dict[str, tuple[StructuredOutputsParams, int, int | None]] = {
    "alternating": (ALTERNATING, 0, None),
    "bounded": (BOUNDED, 1, 3),
}


def constrained_reference(
    prompt: list[int], max_tokens: int, constraint: str = "alternating", vocab_size: int = 50256
) -> list[int]:
    """What the hash-logits model generates greedily under `CONSTRAINTS[constraint]`, without the engine.

    The model's logits rank tokens by cyclic distance after the hash's token, so under a mask it takes the first
    allowed token at or after it. The grammar's stop token (allowed where the pattern may end, and the only token
    allowed once it must end) ends the output and is kept as its last token.
    """
    _, min_pairs, max_pairs = CONSTRAINTS[constraint]
    stop = hash_grammar_stop_token_id(vocab_size)
    history = list(prompt)
    output: list[int] = []
    parity = num_pairs = 0
    for _ in range(max_tokens):
        may_end = parity == 0 and num_pairs >= min_pairs
        must_end = max_pairs is not None and num_pairs == max_pairs
        token = next_token(history, vocab_size)
        while not (
            (token == stop and may_end) or (token != stop and token % 2 == parity and not must_end)
        ):
            token = (token + 1) % vocab_size
        output.append(token)
        history.append(token)
        if token == stop:
            break
        num_pairs += parity
        parity ^= 1
    return output


def make_engine_core(
    *,
    async_scheduling: bool = False,
    use_v2_model_runner: bool = True,
    max_num_seqs: int = 4,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 128,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    worker_thread: str = "on",
    model: str = "hash",
    structured_outputs_backend: str = "xgrammar",
    num_speculative_tokens: int = 0,
    draft_model: str | None = None,
    structured_outputs_config: StructuredOutputsConfig | None = None,
) -> EngineCore:
    """An EngineCore on the hash model with the real executor, worker and runner. The worker thread is on by
    default (on CPU "auto" would run steps inline), so overlapped runs really have a batch executing meanwhile.
    `structured_outputs_config`, when given, replaces the one `structured_outputs_backend` makes."""
    return EngineCore(
        EngineConfig(
            model_config=ModelConfig(model=model, max_model_len=max_model_len),
            cache_config=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=policy,  # type: ignore[arg-type]
                async_scheduling=async_scheduling,
                use_v2_model_runner=use_v2_model_runner,
            ),
            parallel_config=ParallelConfig(worker_thread=worker_thread),
            structured_outputs_config=structured_outputs_config
            or StructuredOutputsConfig(backend=structured_outputs_backend),
            speculative_config=_spec_config(num_speculative_tokens, draft_model),
        )
    )  # type: ignore[arg-type]


def _spec_config(num_speculative_tokens: int, draft_model: str | None) -> SpeculativeConfig | None:
    """Speculation with drafts whose accepted lengths vary (`HashOracleProposer`), or with `draft_model`'s
    drafts (method "draft_model"), or None for 0 tokens."""
    if not num_speculative_tokens:
        return None
    if draft_model is not None:
        return SpeculativeConfig("draft_model", num_speculative_tokens, model=draft_model)
    register_hash_oracle()
    return SpeculativeConfig(HASH_ORACLE_METHOD, num_speculative_tokens)


def greedy_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    *,
    resumable: bool = False,
    stop_token_ids: list[int] | None = None,
    eos_token_id: int | None = 50256,
    structured_outputs: StructuredOutputsParams | None = None,
) -> Request:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=eos_token_id == 50256,
        stop_token_ids=stop_token_ids,
        structured_outputs=structured_outputs,
    )
    return Request(request_id, prompt, params, eos_token_id=eos_token_id, resumable=resumable)


def expected_tokens(
    prompt: list[int], max_tokens: int, stop_token: int | None = None, constraint: str | None = None
) -> list[int]:
    """The hash-model output (under `CONSTRAINTS[constraint]` if given), cut after the first `stop_token` (which
    is kept, as EOS and stop ids are)."""
    tokens = (
        constrained_reference(prompt, max_tokens, constraint)
        if constraint is not None
        else reference_tokens(prompt, max_tokens)
    )
    if stop_token is not None and stop_token in tokens:
        del tokens[tokens.index(stop_token) + 1 :]
    return tokens


class EngineProbe:
    """Checks every SchedulerOutput a core sends to its worker (see the module docstring).

    Installed by wrapping `core.executor.execute_model` (engine thread: checks against the scheduler's state) and
    `core.executor.worker.execute_model` (worker thread, in execution order: the slot model against the runner).
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.use_v2 = core.scheduler.use_v2_model_runner
        self.max_num_seqs = core.scheduler.max_num_running_reqs
        self.runner = core.executor.worker.model_runner
        self.slot_model = WorkerSlots(self.max_num_seqs) if self.use_v2 else None
        self.prev_executed_ids: set[str] = set()
        self.num_outputs_sent = 0
        self.max_batch_queue = 0
        self.max_in_flight = 0  # batches launched and not yet applied, counted when one is launched
        self.sent_order: list[int] = []  # id() of each SchedulerOutput, as the engine sent them
        self.run_order: list[int] = []  # ... and as the worker ran them
        self.session_ids: set[str] = set()
        # Called right after a batch is handed to the executor, before the step applies any output: events there
        # meet every batch in flight (two with async scheduling: the one just launched and the one before).
        self.mid_step_hook: Callable[[SchedulerOutput], None] | None = None
        executor = core.executor
        worker = executor.worker
        send = executor.execute_model
        run_on_worker = worker.execute_model

        def checked_send(scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
            self._check_sent(scheduler_output)
            self.max_in_flight = max(self.max_in_flight, len(core.batch_queue) + 1)
            assert self.max_in_flight <= core.batch_queue_size, (
                "more batches in flight than the queue allows"
            )
            self.sent_order.append(id(scheduler_output))
            result = send(scheduler_output, non_block=non_block)  # type: ignore[call-overload]
            if self.mid_step_hook is not None:
                self.mid_step_hook(scheduler_output)
            return result

        def checked_run(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
            self.run_order.append(id(scheduler_output))
            self._check_on_worker(scheduler_output)
            model_runner_output = run_on_worker(scheduler_output)
            self._check_worker_state()
            return model_runner_output

        executor.execute_model = checked_send  # type: ignore[method-assign]
        worker.execute_model = checked_run  # type: ignore[method-assign]

    # ------------------------------------------------------------------------------------------------ checks
    def _check_sent(self, output: SchedulerOutput) -> None:
        """Engine thread, right after `schedule()`: bounds and traffic against the scheduler's own state."""
        scheduler = self.scheduler
        self.num_outputs_sent += 1
        assert scheduler.num_slot_holders <= self.max_num_seqs, "slot holders exceed max_num_seqs"
        assert output.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens
        assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
        cached = output.scheduled_cached_reqs
        if self.use_v2:
            assert not cached.all_token_ids, (
                "the slot runner never reads a cached request's all_token_ids"
            )
            assert not cached.resumed_req_ids, (
                "the slot runner gets resumed requests as new requests"
            )
        else:
            for req_id in cached.all_token_ids:
                assert req_id in cached.resumed_req_ids or req_id not in self.prev_executed_ids, (
                    f"redundant all_token_ids for {req_id!r}: the worker ran it in the previous step"
                )
        for new_req in output.scheduled_new_reqs:
            request = scheduler.requests[new_req.req_id]
            if new_req.prefill_token_ids is not None:
                assert request.num_preemptions > 0, "prefill_token_ids only for resumed requests"
        for index, req_id in enumerate(cached.req_ids):
            if cached.new_token_ids[index]:
                assert req_id in self.session_ids, (
                    "only a session's new chunk travels as new_token_ids"
                )
        for request in scheduler.requests.values():
            assert request.num_output_placeholders >= 0, f"negative placeholders: {request}"
            assert request.async_tokens_to_discard >= 0, f"negative discard count: {request}"
        self.prev_executed_ids = set(output.num_scheduled_tokens)

    def _check_on_worker(self, output: SchedulerOutput) -> None:
        """Worker thread, before the runner applies the output: the slot model takes the same step."""
        if self.slot_model is None:
            return
        released = output.finished_req_ids | output.preempted_req_ids
        still_held = self.slot_model.held - released
        for new_req in output.scheduled_new_reqs:
            assert new_req.req_id not in still_held, (
                f"{new_req.req_id!r} sent as new while it holds a slot"
            )
        self.slot_model.apply(output)  # raises AssertionError("No free indices") on over-admission

    def _check_worker_state(self) -> None:
        slots = self.runner.slots
        assert len(slots.free_indices) + len(slots.req_id_to_index) == self.max_num_seqs
        if self.slot_model is not None:
            assert self.slot_model.held == set(slots.req_id_to_index), (
                f"slot model {sorted(self.slot_model.held)} != runner {sorted(slots.req_id_to_index)}"
            )

    def check_after_step(self) -> None:
        core = self.core
        assert len(core.batch_queue) <= core.batch_queue_size, "batch queue over its bound"
        self.max_batch_queue = max(self.max_batch_queue, len(core.batch_queue))
        assert self.scheduler.num_slot_holders <= self.max_num_seqs
        for request in self.scheduler.requests.values():
            assert request.num_output_placeholders >= 0 and request.async_tokens_to_discard >= 0, (
                request
            )
        if core.pause_effective():
            assert not core.batch_queue, "a batch is in flight while a pause is in effect"

    def check_idle_and_clean(self) -> None:
        """Nothing left anywhere: no work, no KV block, no slot, no parked state, no stale placeholder."""
        core, scheduler = self.core, self.scheduler
        assert not core.has_work(), "the engine still has work"
        assert not core.batch_queue
        pool = scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
        assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
        assert not scheduler.running and not scheduler.waiting
        assert scheduler.num_waiting_for_streaming_input == 0
        assert not getattr(scheduler, "_stale_placeholders", {}), (
            "stale-placeholder counts left behind"
        )
        slots = self.runner.slots
        assert len(slots.free_indices) == self.max_num_seqs, (
            f"worker slots leaked: {slots.req_id_to_index}"
        )
        # Only the persistent-batch runner parks requests.
        parked = getattr(self.runner, "parked", {})
        assert not parked, f"parked requests leaked: {list(parked)}"
        assert self.run_order == self.sent_order, "the worker ran the batches out of order"
        if self.slot_model is not None:
            assert not self.slot_model.held


class EngineDriver:
    """Steps a core by hand for the deterministic tests, with an `EngineProbe` installed, collecting every
    request's tokens, finish reason and per-output weight versions."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.probe = EngineProbe(core)
        self.expected: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.weight_versions: dict[str, list[int]] = {}
        self.num_steps = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, **options: Any) -> None:
        if options.get("resumable"):
            self.probe.session_ids.add(request_id)
        self.core.add_request(greedy_request(request_id, prompt, max_tokens, **options))
        self.expected[request_id] = reference_tokens(prompt, max_tokens)
        self.tokens.setdefault(request_id, [])

    def step(self) -> list[EngineCoreOutput]:
        outputs = self.core.step()
        self.num_steps += 1
        self.probe.check_after_step()
        self.record(outputs)
        return outputs

    def record(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            assert output.request_id not in self.finish_reasons, f"output after finish: {output}"
            self.tokens[output.request_id].extend(output.new_token_ids)
            if output.new_token_ids:
                self.weight_versions.setdefault(output.request_id, []).append(output.weight_version)
            if output.finished:  # a streaming session's chunk may end while the session goes on
                self.finish_reasons[output.request_id] = output.finish_reason  # type: ignore[assignment]

    def pause(self, mode: str, clear_cache: bool = True) -> list[EngineCoreOutput]:
        outputs = self.core.pause_generation(mode, clear_cache)
        self.record(outputs)
        return outputs

    def step_until(self, condition: Callable[[], bool], max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if condition():
                return
            self.step()
        raise AssertionError("condition not reached")

    def run(self, max_steps: int = 2000) -> None:
        """Step until idle (a paused core must be resumed first), then check nothing leaked."""
        for _ in range(max_steps):
            if not self.core.has_work():
                self.probe.check_idle_and_clean()
                return
            self.step()
        raise AssertionError("the engine did not go idle")

    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.tokens.values())

    def assert_exact(self, request_ids: list[str] | None = None) -> None:
        for request_id in request_ids if request_ids is not None else list(self.expected):
            assert self.tokens[request_id] == self.expected[request_id], (
                f"{request_id}: got {self.tokens[request_id]}, expected {self.expected[request_id]}"
            )
            assert self.finish_reasons.get(request_id) == "length", (
                request_id,
                self.finish_reasons.get(request_id),
            )

    def assert_aborted_prefix(self, request_id: str) -> None:
        tokens = self.tokens[request_id]
        assert self.finish_reasons.get(request_id) == "abort", (
            request_id,
            self.finish_reasons.get(request_id),
        )
        assert tokens == self.expected[request_id][: len(tokens)], (
            f"{request_id}: {tokens} is not a prefix"
        )
