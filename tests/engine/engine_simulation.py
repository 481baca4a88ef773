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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.models.hash_model import hash_grammar_stop_token_id
from kvflow.request import RequestStatus
from tests.engine.engine_probe import (
    ALTERNATING,
    BOUNDED,
    CONSTRAINTS,
    PAUSE_MODES,
    EngineDriver,
    EngineProbe,
    constrained_reference,
    expected_tokens,
    greedy_request,
    make_engine_core,
)
from tests.engine.simulation import Chunk, Simulation, Track

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerOutput

# The core-making helpers, the probe and the driver live in engine_probe.py; importable from here too.
__all__ = [
    "ALTERNATING",
    "BOUNDED",
    "CONSTRAINTS",
    "PAUSE_MODES",
    "EngineDriver",
    "EngineProbe",
    "EngineSimConfig",
    "EngineSimulation",
    "EngineTrack",
    "PauseEpisode",
    "SimStats",
    "constrained_reference",
    "expected_tokens",
    "greedy_request",
    "make_engine_core",
    "random_config",
]


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
