"""The world the checker drives: a real engine core on the hash model whose executor runs each batch on the
worker model, the checker's expectations, and one `Action` at a time applied to them."""

from __future__ import annotations

import pickle
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvflow.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvflow.core.sched.output import ModelRunnerOutput
from kvflow.engine.core import EngineCore
from kvflow.request import RequestStatus
from kvflow.testing.interleavings.checks import check_clean, check_pause_took_effect, check_sent
from kvflow.testing.interleavings.expectations import Chunk, Track, Tracker
from kvflow.testing.interleavings.keys import scheduler_key
from kvflow.testing.interleavings.model import Action, CheckerConfig, make_request
from kvflow.testing.interleavings.worker import FinishedStep, PagedHashWorker
from kvflow.testing.spec_proposers import HASH_ORACLE_METHOD, register_hash_oracle
from kvflow.testing.worker_slots import WorkerSlots

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerOutput
    from kvflow.core.sched.scheduler import Scheduler
    from kvflow.engine.core import InFlightBatch


def make_engine_core(config: CheckerConfig) -> EngineCore:
    """A real engine core on the hash model (its executor is replaced by the world's `CheckerExecutor`)."""
    return EngineCore(
        EngineConfig(
            model_config=ModelConfig(model="hash", max_model_len=config.max_model_len),
            cache_config=CacheConfig(
                block_size=config.block_size,
                num_kv_blocks=config.num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                async_scheduling=config.async_scheduling,
                use_v2_model_runner=config.use_v2_model_runner,
            ),
            parallel_config=ParallelConfig(worker_thread="off"),
            speculative_config=_speculative_config(config.num_speculative_tokens),
        )
    )


def _speculative_config(num_speculative_tokens: int) -> SpeculativeConfig | None:
    """The hash-oracle method: the scheduler reads only k; `PagedHashWorker` drafts the oracle itself."""
    if not num_speculative_tokens:
        return None
    register_hash_oracle()
    return SpeculativeConfig(HASH_ORACLE_METHOD, num_speculative_tokens)


class CheckerExecutor:
    """Stands in for the engine core's executor: checks each batch as it goes out, then runs it on the world's
    `PagedHashWorker` (and `WorkerSlots`) with the outcome the current action chose."""

    num_kv_blocks: int

    def __init__(self, world: World) -> None:
        self.world = world
        self.outcome_index = 0

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        model_runner_output = self.world.run_on_worker(scheduler_output, self.outcome_index)
        return (
            FinishedStep(scheduler_output, model_runner_output)
            if non_block
            else model_runner_output
        )

    def shutdown(self) -> None:
        pass


class World:
    """The engine core, the worker model and the checker's expectations, driven one `Action` at a time.

    `snapshot()` / `restore()` save and bring back everything mutable (the core object itself is reused: its
    scheduler, batch queue and pause are swapped in). `key()` is the canonical state (see the package docstring).
    """

    def __init__(self, config: CheckerConfig) -> None:
        self.config = config
        self.specs = {spec.request_id: spec for spec in config.requests}
        self.core = make_engine_core(config)
        real_executor = self.core.executor
        self.executor = CheckerExecutor(self)
        self.executor.num_kv_blocks = real_executor.num_kv_blocks
        self.core.executor = self.executor  # type: ignore[assignment]
        real_executor.shutdown()
        self.worker = PagedHashWorker(
            config.max_num_seqs,
            config.block_size,
            config.num_blocks,
            config.use_v2_model_runner,
            config.max_model_len,
            config.num_speculative_tokens,
        )
        self.slots = WorkerSlots(config.max_num_seqs) if config.use_v2_model_runner else None
        self.tracker = Tracker()
        self.events: Counter[str] = Counter()  # see `SearchResult.events`; not part of the state
        # While an action is applied: its batches with a choice of outcomes (at most one), and their number.
        self.applying = False
        self.num_choice_batches = 0
        self.num_outcomes = 1

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # ------------------------------------------------------------------------------------------------ snapshots
    def snapshot(self) -> bytes:
        core = self.core
        state = (
            core.scheduler,
            core.batch_queue,
            core.pause,
            self.worker,
            self.slots,
            self.tracker,
        )
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, snapshot: bytes) -> None:
        core = self.core
        (core.scheduler, core.batch_queue, core.pause, self.worker, self.slots, self.tracker) = (
            pickle.loads(snapshot)
        )

    def key(self) -> int:
        """A hash of the canonical state (64 bits: a collision among the ~10^5 states is ~10^-9 likely)."""
        core = self.core
        pause = core.pause
        # What applying a batch in flight reads: its scheduled requests and drafts, and what the worker sampled.
        batches = tuple(
            (
                tuple(batch.scheduler_output.num_scheduled_tokens.items()),
                frozenset(
                    (req_id, tuple(ids))
                    for req_id, ids in batch.scheduler_output.scheduled_spec_decode_tokens.items()
                ),
                batch.future.result_key,  # type: ignore[attr-defined]
            )
            for batch in core.batch_queue
        )
        return hash(
            (
                scheduler_key(core.scheduler),
                None if pause is None else (pause.mode, pause.clear_cache, pause.in_effect),
                batches,
                self.worker.state_key(),
                None if self.slots is None else frozenset(self.slots.held),
                self.tracker.key(),
            )
        )

    # ------------------------------------------------------------------------------------------------ actions
    def enabled_actions(self) -> list[Action]:
        core, config, tracker = self.core, self.config, self.tracker
        actions: list[Action] = []
        if tracker.num_added < len(config.requests):
            actions.append(Action("add", config.requests[tracker.num_added].request_id))
        for track in tracker.live():
            if track.is_session and track.unfed:
                actions.append(Action("chunk", track.request_id))
        actions += self._engine_step_actions()
        actions += [Action("abort", track.request_id) for track in tracker.live()]
        pool = self.scheduler.kv_cache_manager.block_pool
        if any(block.ref_cnt or block.block_hash is not None for block in pool.blocks):
            actions.append(Action("reset"))
        if core.pause is None:
            actions += [Action("pause", variant) for variant in config.pause_variants]
        else:
            actions.append(Action("resume"))
        return actions

    def _engine_step_actions(self) -> list[Action]:
        core = self.core
        if not self.config.async_scheduling:
            return [Action("step")] if core.can_make_progress() else []
        actions: list[Action] = []
        can_launch = len(core.batch_queue) < core.batch_queue_size and core._has_schedulable_work()
        if can_launch:
            actions.append(Action("launch"))  # its other outcomes follow once the batch shows them
        if core.batch_queue:
            actions.append(Action("complete"))
        elif not can_launch and core.is_paused() and not core.pause_effective():
            actions.append(Action("step"))  # the idle step that puts the pause into effect
        return actions

    def apply(self, action: Action) -> None:
        """Run one action and its transition checks (AssertionError on a violation; `NotApplicable` when the
        worker has no such outcome)."""
        core = self.core
        frozen = core.pause_effective()  # a pause in effect: nothing may be emitted
        num_preemptions, num_to_drop = core.scheduler.num_preemptions_total, self._num_to_drop()
        self.executor.outcome_index = action.outcome
        self.num_choice_batches, self.num_outcomes, self.applying = 0, 1, True
        try:
            outputs = getattr(self, f"_do_{action.kind}")(action)
        finally:
            self.executor.outcome_index, self.applying = 0, False  # the drain takes outcome 0
        assert self.num_choice_batches <= 1, "an action ran two batches with a choice of outcomes"
        for output in outputs:
            self.tracker.consume(output, frozen)
            if output.session_continues:
                self.events["session_chunk"] += 1
        if (
            action.kind in ("step", "launch")
            and core.scheduler.num_preemptions_total > num_preemptions
        ):
            self.events["preempted_in_step"] += 1
        if self._num_to_drop() < num_to_drop:
            self.events["dropped_in_flight"] += 1
        assert len(core.batch_queue) <= core.batch_queue_size, "batch queue over its bound"
        if core.pause_effective():
            assert not core.batch_queue, "a batch is in flight while a pause is in effect"
            if not frozen:
                check_pause_took_effect(self)

    def _num_to_drop(self) -> int:
        scheduler = self.core.scheduler
        stale = getattr(scheduler, "_stale_placeholders", {})
        num_to_discard = sum(
            request.async_tokens_to_discard for request in scheduler.requests.values()
        )
        return sum(stale.values()) + num_to_discard

    def _do_add(self, action: Action) -> list[EngineCoreOutput]:
        spec = self.specs[action.arg]
        tracker = self.tracker
        self.core.add_request(
            make_request(spec.request_id, spec.prompt, spec.max_tokens, spec.resumable)
        )
        tracker.tracks[spec.request_id] = Track(
            spec.request_id,
            spec.resumable,
            [Chunk(spec.prompt, spec.max_tokens)],
            unfed=list(spec.chunks),
        )
        tracker.num_added += 1
        if tracker.held_by_wait is not None and not spec.resumable:
            tracker.held_by_wait = tracker.held_by_wait | {spec.request_id}
        return []

    def _do_chunk(self, action: Action) -> list[EngineCoreOutput]:
        track = self.tracker.tracks[action.arg]
        update = track.unfed.pop(0)
        request = self.scheduler.requests[track.request_id]
        idle = request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
        self.core.add_request(make_request(track.request_id, update[0], update[1], True))
        if idle:
            track.fold(update)  # applied at once
        else:
            track.sent.append(update)  # applied when the running round stops
        return []

    def _do_step(self, action: Action) -> list[EngineCoreOutput]:
        return self.core.step()

    def _do_launch(self, action: Action) -> list[EngineCoreOutput]:
        core = self.core
        if core.pause_effective():
            return core.step()  # only report batches go out, and they are applied at once
        core._launch_batch()
        return core._settle_pause()

    def _do_complete(self, action: Action) -> list[EngineCoreOutput]:
        core = self.core
        if self._verifies_stale_drafts(core.batch_queue[0]):
            self.events["dropped_draft_step"] += 1
        return core._apply_oldest_batch() + core._settle_pause()

    def _verifies_stale_drafts(self, batch: InFlightBatch) -> bool:
        """Whether the batch verified drafts for a request whose output of it is stale (to be dropped)."""
        scheduler = self.scheduler
        output = batch.future.model_runner_output  # type: ignore[attr-defined]
        for req_id in batch.scheduler_output.scheduled_spec_decode_tokens:
            if not output.sampled_token_ids[output.req_id_to_index[req_id]]:
                continue
            request = scheduler.requests.get(req_id)
            if request is None or request.is_finished() or request.async_tokens_to_discard:
                return True
        return False

    def _do_abort(self, action: Action) -> list[EngineCoreOutput]:
        self.core.abort_requests([action.arg])
        assert action.arg not in self.scheduler.requests, "an aborted request is still there"
        track = self.tracker.tracks[action.arg]
        track.aborted = track.done = True
        return []

    def _do_reset(self, action: Action) -> list[EngineCoreOutput]:
        assert self.core.reset_prefix_cache(reset_running_requests=True), "forced reset refused"
        assert not self.scheduler.running, "a forced reset left running requests"
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks, "a forced reset left blocks in use"
        return []

    def _do_pause(self, action: Action) -> list[EngineCoreOutput]:
        mode, clear_cache = action.arg
        core, tracker = self.core, self.tracker
        if mode == "wait":
            started = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
            tracker.held_by_wait = frozenset(
                track.request_id
                for track in tracker.live()
                if not track.is_session
                and self.scheduler.requests[track.request_id].status not in started
            )
        outputs = core.pause_generation(mode, clear_cache)
        if mode == "abort":
            live = {track.request_id for track in tracker.live()}
            assert {output.request_id for output in outputs} == live, (
                "an abort pause missed requests"
            )
            assert not self.scheduler.requests, "an abort pause left requests"
        return outputs

    def _do_resume(self, action: Action) -> list[EngineCoreOutput]:
        self.core.resume_generation()
        self.tracker.held_by_wait = None
        return []

    # ------------------------------------------------------------------------------------------------ worker side
    def run_on_worker(
        self, scheduler_output: SchedulerOutput, outcome_index: int
    ) -> ModelRunnerOutput:
        """A batch goes out: check it against the scheduler, apply it to the slot model, run it on the worker."""
        check_sent(self, scheduler_output)
        if self.slots is not None:
            # Raises AssertionError("No free indices") on over-admission.
            self.slots.apply(scheduler_output)
        model_runner_output = self.worker.execute(scheduler_output, outcome_index)
        if self.worker.num_outcomes > 1:
            self.num_choice_batches += 1
            self.num_outcomes = self.worker.num_outcomes
        if self.applying:  # events count the search's transitions, not the drains
            self.events.update(self.worker.step_events)
            if any(new_req.num_computed_tokens for new_req in scheduler_output.scheduled_new_reqs):
                self.events["prefix_hit"] += 1
        return model_runner_output

    # ------------------------------------------------------------------------------------------------ drain
    def drain(self, drained_ok: set[int], key: int) -> int | None:
        """Resume, close open sessions, step until idle, then check that nothing is left and every output is the
        oracle's. `key` is the state's key. States already known to drain cleanly (`drained_ok`) end it early; the
        states this drain passes through are added. Returns the number of steps run, or None when the state was
        already known (then the world is unchanged)."""
        core, tracker = self.core, self.tracker
        touched = core.is_paused() or any(
            track.is_session and not track.closing for track in tracker.live()
        )
        if core.is_paused():
            core.resume_generation()
            tracker.held_by_wait = None
        for track in tracker.live():
            if track.is_session and not track.closing:
                request = self.scheduler.requests[track.request_id]
                idle = request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
                ended = core.close_session(track.request_id)
                assert ended == idle, f"close_session of {track.request_id!r} returned {ended}"
                track.closing = True
                track.done = ended
        passed: list[int] = []
        for num_steps in range(self.config.max_drain_steps):
            if touched or num_steps:
                key = self.key()
            if key in drained_ok:
                break
            passed.append(key)
            if not core.has_work():
                check_clean(self)
                break
            for output in core.step():
                tracker.consume(output, frozen=False)
        else:
            raise AssertionError(
                f"the engine did not go idle in {self.config.max_drain_steps} steps"
            )
        drained_ok.update(passed)
        return num_steps if touched or passed else None
