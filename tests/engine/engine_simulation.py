"""A randomized simulation one level up from `simulation.py`: the whole `EngineCore` (scheduler, uniproc executor,
worker, real model runner, hash model), stepped synchronously or overlapped (`async_scheduling`: two batches in
flight), with adds, aborts in every state, forced resets with 0, 1 or 2 batches in flight, pauses in every mode
(abort / wait / keep, with and without `clear_cache`), repeated pauses, resumes, requests arriving while paused,
stop tokens and streaming-input sessions interleaved at random. With `structured_fraction`, the core runs the
hash-logits model and that share of requests is constrained by a real grammar (xgrammar, or llguidance) whose
constrained output is computable too (`constrained_reference`), so a matcher that advanced on a discarded in-flight
token, or missed a kept one, shows as a wrong token.

`EngineProbe` wraps the executor and the worker of a core so that every `SchedulerOutput` is checked as it goes
out: the slot model (`WorkerSlots`) must agree with the real runner's slots and never overflow, a new request
never takes a slot its id already holds, the slot protocol never receives a history it does not read, and the
persistent-batch protocol receives `all_token_ids` only for requests it did not run in the previous step.

`EngineSimulation` checks after every step: the batch queue is within its bound, slot holders are within
`max_num_seqs`, no placeholder or discard count is negative, no token is emitted once a pause has taken effect,
"wait" pauses emit nothing for held requests and finish the started ones before taking effect, an "abort" pause
finishes every request, and the run never stalls. At the end every finished request (and session chunk) equals
the hash-model reference, aborted ones are prefixes of it, and no KV block, worker slot, parked state, stale placeholder
or request is left.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
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
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.spec_proposers import HASH_ORACLE_METHOD, register_hash_oracle
from kvflow.testing.worker_slots import WorkerSlots
from tests.engine.simulation import Chunk, Simulation, Track

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


@dataclass
class EngineSimConfig:
    use_v2_model_runner: bool = True
    async_scheduling: bool = False
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 5
    num_blocks: int = 36
    block_size: int = 4
    max_num_batched_tokens: int = 40
    num_requests: int = 40
    session_fraction: float = 0.2
    stop_fraction: float = 0.25
    abort_probability: float = 0.04
    reset_probability: float = 0.04
    mid_step_probability: float = 0.04  # a reset or an abort while the step's batches are in flight
    pause_probability: float = 0.04
    repause_probability: float = 0.08
    resume_probability: float = 0.25
    pause_modes: tuple[str, ...] = PAUSE_MODES
    abort_pause_weight: float = (
        0.5  # relative to 1 for "wait" and "keep" (an abort pause ends every request)
    )
    max_steps: int = 5000
    max_stall_steps: int = 80
    reuse_id_probability: float = 0.15
    # Share of (non-session) requests constrained by ALTERNATING; > 0 runs the hash-logits model.
    structured_fraction: float = 0.0
    structured_outputs_backend: str = "xgrammar"
    # > 0: speculative decoding with this many drafts per step, from `HashOracleProposer` (varied acceptance).
    num_speculative_tokens: int = 0
    # With num_speculative_tokens: draft with the hash-logits model itself as a draft model (method
    # "draft_model", its own paged KV cache), the target being hash-logits too: every draft it proposes from
    # correct K/V is the target's own next token, so anything short of full acceptance is a draft-cache bug.
    draft_model: bool = False


@dataclass
class EngineTrack(Track):
    """A `Track` (simulation.py) plus the stop token a non-session request was given (None: runs to max_tokens)
    and the name of its constraint in `CONSTRAINTS` (None: unconstrained)."""

    stop_token: int | None = None
    constraint: str | None = None


@dataclass
class PauseEpisode:
    """One pause (from the first pause call to resume), as the test expects it to behave."""

    mode: str
    clear_cache: bool
    must_finish: set[str] = field(
        default_factory=set
    )  # "wait": non-session requests started at the call
    held: set[str] = field(
        default_factory=set
    )  # "wait": non-session requests not started, and arrivals
    seen_effective: bool = False


@dataclass
class SimStats:
    """What a run exercised (tests assert coverage on these)."""

    num_steps: int = 0
    resets_by_batches_in_flight: dict[int, int] = field(default_factory=dict)
    num_double_resets: int = 0
    aborts_by_state: dict[str, int] = field(default_factory=dict)
    pauses: dict[tuple[str, bool], int] = field(default_factory=dict)
    num_effective: int = 0
    num_repauses: int = 0
    num_resume_while_pending: int = 0
    num_resume_without_pause: int = 0
    num_added_while_paused: int = 0
    num_preemptions: int = 0
    max_batch_queue: int = 0
    max_in_flight: int = 0
    num_stopped: int = 0
    num_reused_ids: int = 0
    num_grammar_stops: int = 0


class EngineSimulation:
    """Drives one randomized EngineCore run; see the module docstring for what it checks."""

    def __init__(self, config: EngineSimConfig, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.max_model_len = config.num_blocks * config.block_size
        self.core = make_engine_core(
            async_scheduling=config.async_scheduling,
            use_v2_model_runner=config.use_v2_model_runner,
            max_num_seqs=config.max_num_seqs,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_num_batched_tokens=(
                config.max_num_batched_tokens
                if config.enable_chunked_prefill
                else max(config.max_num_batched_tokens, self.max_model_len)
            ),
            max_model_len=self.max_model_len,
            policy=config.policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            model="hash-logits" if config.structured_fraction > 0 or config.draft_model else "hash",
            structured_outputs_backend=config.structured_outputs_backend,
            num_speculative_tokens=config.num_speculative_tokens,
            draft_model="hash-logits" if config.draft_model else None,
        )
        if config.structured_fraction > 0:
            # Compile the grammar once up front: the run then never waits on the compiler.
            manager = self.core.structured_output_manager
            assert manager is not None
            for params, _, _ in CONSTRAINTS.values():
                manager._compile(params).result()
        self.scheduler = self.core.scheduler
        self.probe = EngineProbe(self.core)
        self.probe.mid_step_hook = self._mid_step_events
        self.tracks: dict[str, EngineTrack] = {}
        self.finished_tracks: list[EngineTrack] = []  # earlier requests whose id was reused
        self.episode: PauseEpisode | None = None
        self.num_added = 0
        self.stall_steps = 0
        self.stats = SimStats()

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> SimStats:
        try:
            self._run()
            self.probe.check_idle_and_clean()
            for track in [*self.finished_tracks, *self.tracks.values()]:
                self._check_track(track)
        finally:
            self.core.shutdown()
        self.stats.num_preemptions = self.scheduler.num_preemptions_total
        self.stats.max_batch_queue = self.probe.max_batch_queue
        self.stats.max_in_flight = self.probe.max_in_flight
        return self.stats

    def _run(self) -> None:
        while self.num_added < self.config.num_requests or self._has_work():
            self.stats.num_steps += 1
            assert self.stats.num_steps <= self.config.max_steps, (
                "no progress: the run exceeded its step bound"
            )
            if self.num_added < self.config.num_requests and self.rng.random() < 0.5:
                self._add_request()
            self._random_events()
            self._step()
            self._feed_sessions()

    def _has_work(self) -> bool:
        sessions_open = any(not track.done for track in self.tracks.values())
        return self.core.has_work() or sessions_open or self.episode is not None

    def _step(self) -> None:
        core = self.core
        frozen = core.pause_effective()
        should_progress = core.can_make_progress()
        outputs = core.step()
        if frozen:
            assert not any(output.new_token_ids for output in outputs), (
                "a token was emitted while paused"
            )
        for output in outputs:
            self._consume(output)
        self.probe.check_after_step()
        self._check_pause_effect()
        if should_progress and not outputs:
            self.stall_steps += 1
            assert self.stall_steps <= self.config.max_stall_steps, (
                "the engine stalls with work it could do"
            )
        else:
            self.stall_steps = 0

    # ------------------------------------------------------------------------------------------------ requests
    def _add_request(self) -> None:
        request_id = self._new_request_id()
        self.num_added += 1
        is_session = self.rng.random() < self.config.session_fraction
        prompt = [
            self.rng.randrange(1, 500)
            for _ in range(self.rng.randrange(1, 28 if not is_session else 12))
        ]
        max_tokens = self.rng.randrange(1, 20 if not is_session else 8)
        track = EngineTrack(request_id, is_session, [Chunk(list(prompt), max_tokens)])
        self.tracks[request_id] = track
        stop_token_ids: list[int] | None = None
        eos_token_id: int | None = 50256
        if not is_session and self.rng.random() < self.config.structured_fraction:
            track.constraint = self.rng.choice(sorted(CONSTRAINTS))
        if is_session:
            self.probe.session_ids.add(request_id)
            for _ in range(self.rng.randrange(0, 3)):
                track.pending.append(self._random_chunk())
            track.pending.append(None)
        elif self.rng.random() < self.config.stop_fraction:
            stop_token = track.stop_token = self.rng.choice(
                expected_tokens(prompt, max_tokens, constraint=track.constraint)
            )
            if self.rng.random() < 0.5:
                stop_token_ids = [stop_token]
            else:
                eos_token_id = stop_token
        num_unfinished = self.scheduler.get_num_unfinished_requests()
        self.core.add_request(
            greedy_request(
                request_id,
                prompt,
                max_tokens,
                resumable=is_session,
                stop_token_ids=stop_token_ids,
                eos_token_id=eos_token_id,
                structured_outputs=(
                    None if track.constraint is None else CONSTRAINTS[track.constraint][0]
                ),
            )
        )
        # Queued visibly, even while paused: counted as unfinished, waiting (for its grammar, if constrained).
        assert self.scheduler.get_num_unfinished_requests() == num_unfinished + 1
        assert self.scheduler.requests[request_id].status == (
            RequestStatus.WAITING if track.constraint is None else RequestStatus.WAITING_FOR_FSM
        )
        if self.episode is not None:
            self.stats.num_added_while_paused += 1
            if self.episode.mode == "wait" and not is_session:
                self.episode.held.add(request_id)

    def _new_request_id(self) -> str:
        """Usually a fresh id; sometimes one of a finished request (its stale placeholders must not reach the new
        one)."""
        reusable = [
            request_id
            for request_id, track in self.tracks.items()
            if track.done and request_id not in self.scheduler.requests
        ]
        if not reusable or self.rng.random() >= self.config.reuse_id_probability:
            return f"r{self.num_added}"
        request_id = self.rng.choice(reusable)
        self.finished_tracks.append(self.tracks.pop(request_id))
        self.probe.session_ids.discard(request_id)
        if self.episode is not None:
            self.episode.must_finish.discard(request_id)
            self.episode.held.discard(request_id)
        self.stats.num_reused_ids += 1
        return request_id

    def _random_chunk(self) -> tuple[list[int], int]:
        return [
            self.rng.randrange(1, 500) for _ in range(self.rng.randrange(1, 10))
        ], self.rng.randrange(1, 8)

    def _feed_sessions(self) -> None:
        """As in simulation.py: idle sessions get their next chunk (or the close), running ones sometimes early."""
        for track in self.tracks.values():
            if not track.is_session or track.done or not track.pending:
                continue
            request = self.scheduler.requests.get(track.request_id)
            idle = request is not None and request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
            if self.rng.random() < (0.3 if idle else 0.9):
                continue  # idle sessions linger a little (holding their slot); running ones mostly finish first
            update = track.pending.popleft()
            prompt, max_tokens = update if update is not None else ([], 1)
            self.core.add_request(
                greedy_request(track.request_id, prompt, max_tokens, resumable=update is not None)
            )
            if update is None:
                track.done = track.done or idle
            elif idle:
                Simulation._fold(track, update)
            else:
                track.sent.append(update)

    def _consume(self, output: EngineCoreOutput) -> None:
        track = self.tracks[output.request_id]
        assert not track.done, f"output for finished request {track.request_id}: {output}"
        episode = self.episode
        if episode is not None and episode.mode == "wait" and output.request_id in episode.held:
            assert not output.new_token_ids, (
                f"{output.request_id} produced tokens while held by a wait pause"
            )
        assert output.weight_version == self.core.weight_version
        chunk = track.chunks[-1]
        chunk.tokens.extend(output.new_token_ids)
        assert len(chunk.tokens) <= chunk.max_tokens, (
            f"{track.request_id} produced more than max_tokens"
        )
        if output.finish_reason is None:
            return
        chunk.finish_reason = output.finish_reason
        if output.finish_reason == "abort":
            track.aborted = True
        if output.finish_reason == "stop":
            self.stats.num_stopped += 1
            if track.constraint is not None and chunk.tokens[-1:] == [hash_grammar_stop_token_id()]:
                self.stats.num_grammar_stops += 1
        if not output.session_continues:
            track.done = True
        elif track.sent:
            Simulation._fold(track, track.sent.popleft())

    # ------------------------------------------------------------------------------------------------ events
    def _random_events(self) -> None:
        rng, config = self.rng, self.config
        if rng.random() < config.abort_probability:
            self._abort_one()
        if rng.random() < config.reset_probability:
            self._forced_reset()
            if rng.random() < 0.3:
                self.stats.num_double_resets += 1
                self._forced_reset()
        if rng.random() < 0.02:
            busy = any(block.ref_cnt for block in self.scheduler.kv_cache_manager.block_pool.blocks)
            assert self.core.reset_prefix_cache() == (not busy)
        self._pause_events()

    def _mid_step_events(self, launched: SchedulerOutput) -> None:
        """Between launching a batch and applying the oldest output (see `EngineProbe.mid_step_hook`)."""
        if self.rng.random() >= self.config.mid_step_probability:
            return
        if self.rng.random() < 0.6:
            self._forced_reset(num_launching=1)
        else:
            self._abort_one(launched)

    def _abort_one(self, launched: SchedulerOutput | None = None) -> None:
        """Abort a live request, picking its state first so that rare states (idle sessions) get their share."""
        by_status: dict[RequestStatus, list[EngineTrack]] = {}
        for track in self.tracks.values():
            request = self.scheduler.requests.get(track.request_id)
            if not track.done and request is not None:
                by_status.setdefault(request.status, []).append(track)
        if by_status:
            self._abort(self.rng.choice(by_status[self.rng.choice(sorted(by_status))]), launched)

    def _abort(self, track: EngineTrack, launched: SchedulerOutput | None = None) -> None:
        request = self.scheduler.requests.get(track.request_id)
        in_flight = any(
            track.request_id in output.num_scheduled_tokens
            for output in [
                *(batch.scheduler_output for batch in self.core.batch_queue),
                *([launched] if launched else []),
            ]
        )
        state = (
            "gone"
            if request is None
            else ("in_flight" if in_flight else request.status.name.lower())
        )
        if self.core.is_paused():
            state += "/paused"
        self.stats.aborts_by_state[state] = self.stats.aborts_by_state.get(state, 0) + 1
        self.core.abort_requests([track.request_id])
        assert track.request_id not in self.scheduler.requests
        track.aborted = track.done = True

    def _forced_reset(self, num_launching: int = 0) -> None:
        in_flight = len(self.core.batch_queue) + num_launching
        counts = self.stats.resets_by_batches_in_flight
        counts[in_flight] = counts.get(in_flight, 0) + 1
        assert self.core.reset_prefix_cache(reset_running_requests=True)
        assert not self.scheduler.running
        pool = self.scheduler.kv_cache_manager.block_pool
        assert not pool.cached_block_hash_to_block
        assert pool.get_num_free_blocks() == pool.num_blocks

    def _pause_events(self) -> None:
        rng, config, core = self.rng, self.config, self.core
        if self.episode is None:
            if rng.random() < config.pause_probability:
                self._pause(self._random_mode(), rng.random() < 0.5)
            elif rng.random() < 0.01:
                self.stats.num_resume_without_pause += 1
                core.resume_generation()  # harmless
                assert not core.is_paused()
            return
        if rng.random() < config.repause_probability:
            self.stats.num_repauses += 1
            mode = self.episode.mode if rng.random() < 0.5 else self._random_mode()
            self._pause(mode, rng.random() < 0.5)
        elif core.pause_effective() and rng.random() < config.resume_probability:
            self._resume()
        elif not core.pause_effective() and rng.random() < 0.03:
            self.stats.num_resume_while_pending += 1
            self._resume()

    def _random_mode(self) -> str:
        modes = self.config.pause_modes
        weights = [self.config.abort_pause_weight if mode == "abort" else 1.0 for mode in modes]
        return self.rng.choices(modes, weights)[0]

    def _pause(self, mode: str, clear_cache: bool) -> None:
        core = self.core
        was_pending = core.is_paused() and not core.pause_effective()
        key = (mode, clear_cache)
        self.stats.pauses[key] = self.stats.pauses.get(key, 0) + 1
        unfinished = {
            request_id
            for request_id, request in self.scheduler.requests.items()
            if not request.is_finished()
        }
        expected_clear = (
            (self.episode.clear_cache or clear_cache)
            if self.episode and was_pending
            else clear_cache
        )
        self.episode = episode = PauseEpisode(mode, expected_clear)
        if mode == "wait":
            for request_id, request in self.scheduler.requests.items():
                if self.tracks[request_id].is_session:
                    continue
                if request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                    episode.must_finish.add(request_id)
                else:
                    episode.held.add(request_id)
        outputs = core.pause_generation(mode, clear_cache)
        assert core.is_paused()
        if mode == "abort":
            assert {output.request_id for output in outputs} == unfinished
            assert all(
                output.finish_reason == "abort" and not output.new_token_ids for output in outputs
            )
        for output in outputs:
            self._consume(output)
        if mode == "abort":
            assert all(track.done for track in self.tracks.values()), (
                "an abort pause left a request running"
            )
            assert not self.scheduler.requests
        self._check_pause_effect()

    def _resume(self) -> None:
        self.core.resume_generation()
        assert not self.core.is_paused() and not self.core.pause_effective()
        self.episode = None

    def _check_pause_effect(self) -> None:
        """At the moment a pause takes effect: nothing in flight, started requests done ("wait"), cache clear."""
        episode, core = self.episode, self.core
        if episode is None or episode.seen_effective or not core.pause_effective():
            return
        episode.seen_effective = True
        self.stats.num_effective += 1
        assert not core.batch_queue, "a pause took effect with a batch in flight"
        if episode.mode == "wait":
            unfinished = [
                request_id for request_id in episode.must_finish if not self.tracks[request_id].done
            ]
            assert not unfinished, (
                f"a wait pause took effect before started requests finished: {unfinished}"
            )
        if episode.clear_cache:
            assert not self.scheduler.running, "clear_cache left running requests"
            pool = self.scheduler.kv_cache_manager.block_pool
            assert pool.get_num_free_blocks() == pool.num_blocks, (
                "clear_cache left KV blocks in use"
            )
            assert not pool.cached_block_hash_to_block, "clear_cache left the prefix cache"

    # ------------------------------------------------------------------------------------------------ checks
    @staticmethod
    def _check_track(track: EngineTrack) -> None:
        if track.is_session:
            Simulation._check_track(track)
            return
        chunk = track.chunks[0]
        expected = expected_tokens(
            chunk.prompt, chunk.max_tokens, track.stop_token, constraint=track.constraint
        )
        if track.aborted:
            assert chunk.tokens == expected[: len(chunk.tokens)], (
                f"{track.request_id}: aborted output {chunk.tokens} is not a prefix of {expected}"
            )
            return
        assert chunk.tokens == expected, (
            f"{track.request_id}: got {chunk.tokens}, expected {expected}"
        )
        # Stop tokens are checked before the length cap: a last allowed token that is the stop token is "stop",
        # and so is the grammar's stop token, which completes the constraint.
        stopped = track.stop_token is not None and expected[-1:] == [track.stop_token]
        stopped |= track.constraint is not None and expected[-1:] == [hash_grammar_stop_token_id()]
        expected_reason = "stop" if stopped or len(expected) < chunk.max_tokens else "length"
        assert chunk.finish_reason == expected_reason, (track.request_id, chunk.finish_reason)


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


def random_config(seed: int) -> EngineSimConfig:
    """A config drawn at random from the whole space the harness supports (both protocols, sync and async, both
    policies, chunked prefill on and off, from one slot to many, tight to ample KV cache, all event rates)."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    return EngineSimConfig(
        use_v2_model_runner=rng.random() < 0.5,
        async_scheduling=rng.random() < 0.6,
        policy=rng.choice(["fcfs", "priority"]),
        enable_chunked_prefill=rng.random() < 0.8,
        max_num_seqs=rng.randrange(1, 9),
        block_size=block_size,
        num_blocks=rng.randrange(
            max(14, -(-64 // block_size)), 60
        ),  # max_model_len >= 64: every prompt fits
        max_num_batched_tokens=rng.choice([8, 16, 40, 100]),
        num_requests=rng.randrange(10, 80),
        session_fraction=rng.random() * 0.5,
        stop_fraction=rng.random() * 0.5,
        abort_probability=rng.random() * 0.1,
        reset_probability=rng.random() * 0.1,
        mid_step_probability=rng.random() * 0.1,
        pause_probability=rng.random() * 0.1,
        repause_probability=rng.random() * 0.2,
        resume_probability=0.05 + rng.random() * 0.4,
        reuse_id_probability=rng.random() * 0.3,
    )
