"""A randomized engine simulation: the real scheduler and the real slot runner on the hash model, driven step by
step with adds, aborts, forced resets, streaming-input chunks and KV pressure interleaved at random points.

After every step it checks the three invariants: the worker never runs out of slots (the real runner and the
`WorkerSlots` model both raise on over-admission), no step carries a request's history where the protocol does
not read it, and no placeholder count goes negative. At the end every finished request (and every streaming
chunk) equals the hash-model reference, aborted ones are prefixes of it, no block leaked and `requests` is empty.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from kvflow.core.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.testing import make_scheduler
from kvflow.testing.hash_model import HashModel, reference_tokens
from kvflow.testing.worker_slots import WorkerSlots
from kvflow.worker.worker import get_model_runner_class


@dataclass
class SimConfig:
    use_v2_model_runner: bool = True
    async_scheduling: bool = False
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 6
    num_blocks: int = 40
    block_size: int = 4
    max_num_batched_tokens: int = 48
    num_requests: int = 24
    session_fraction: float = 0.25
    abort_probability: float = 0.04
    reset_probability: float = 0.04
    max_steps: int = 4000


@dataclass
class Chunk:
    """One generation round of a request: the prompt it ran on (folded, for sessions) and what came back."""

    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Track:
    """What the test expects of one request id, chunk by chunk."""

    request_id: str
    is_session: bool
    chunks: list[Chunk]
    pending: deque[tuple[list[int], int] | None] = field(
        default_factory=deque
    )  # to send (None: close)
    sent: deque[tuple[list[int], int]] = field(
        default_factory=deque
    )  # sent while running, not yet applied
    aborted: bool = False
    done: bool = False


class Simulation:
    """Drives one randomized run; see the module docstring for what it checks."""

    def __init__(self, config: SimConfig, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.max_model_len = config.num_blocks * config.block_size
        self.scheduler = make_scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(
                config.max_num_batched_tokens,
                0 if config.enable_chunked_prefill else self.max_model_len,
            ),
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.policy,
            async_scheduling=config.async_scheduling,
            use_v2_model_runner=config.use_v2_model_runner,
        )
        self.runner = get_model_runner_class(config.use_v2_model_runner)(
            HashModel(),
            max_num_reqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
        )
        self.slot_model = WorkerSlots(config.max_num_seqs) if config.use_v2_model_runner else None
        self.tracks: dict[str, Track] = {}
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.num_added = 0
        self.num_steps = 0
        self.num_resets = 0
        self.max_in_flight_at_reset = 0

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> None:
        while self.num_added < self.config.num_requests or self._has_work():
            self.num_steps += 1
            assert self.num_steps <= self.config.max_steps, (
                "no progress: the run exceeded its step bound"
            )
            if self.num_added < self.config.num_requests and self.rng.random() < 0.5:
                self._add_request()
            self._random_events()
            self._schedule_and_execute()
            self._random_events()
            if (
                not self.config.async_scheduling
                or len(self.in_flight) >= 2
                or not self._scheduler_has_work()
            ):
                self._retire_oldest()
            self._feed_sessions()
        self._check_final_state()

    def _has_work(self) -> bool:
        waiting_sessions = any(not track.done for track in self.tracks.values())
        return bool(self.in_flight) or self._scheduler_has_work() or waiting_sessions

    def _scheduler_has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_reports()

    # ------------------------------------------------------------------------------------------------ events
    def _add_request(self) -> None:
        request_id = f"r{self.num_added}"
        self.num_added += 1
        is_session = self.rng.random() < self.config.session_fraction
        prompt = [
            self.rng.randrange(1, 500)
            for _ in range(self.rng.randrange(1, 28 if not is_session else 12))
        ]
        max_tokens = self.rng.randrange(1, 20 if not is_session else 8)
        self.tracks[request_id] = Track(request_id, is_session, [Chunk(list(prompt), max_tokens)])
        if is_session:
            for _ in range(self.rng.randrange(0, 3)):
                self.tracks[request_id].pending.append(self._random_chunk())
            self.tracks[request_id].pending.append(None)
        self.scheduler.add_request(
            self._make_request(request_id, prompt, max_tokens, resumable=is_session)
        )

    def _random_chunk(self) -> tuple[list[int], int]:
        return [
            self.rng.randrange(1, 500) for _ in range(self.rng.randrange(1, 10))
        ], self.rng.randrange(1, 8)

    @staticmethod
    def _make_request(
        request_id: str, prompt: list[int], max_tokens: int, resumable: bool
    ) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return Request(request_id, prompt, params, eos_token_id=50256, resumable=resumable)

    def _random_events(self) -> None:
        if self.rng.random() < self.config.abort_probability:
            live = [track for track in self.tracks.values() if not track.done]
            if live:
                self._abort(self.rng.choice(live))
        if self.rng.random() < self.config.reset_probability:
            self.max_in_flight_at_reset = max(self.max_in_flight_at_reset, len(self.in_flight))
            self.num_resets += 1
            assert self.scheduler.reset_prefix_cache(reset_running_requests=True)
        if self.rng.random() < 0.02:
            busy = any(block.ref_cnt for block in self.scheduler.kv_cache_manager.block_pool.blocks)
            assert self.scheduler.reset_prefix_cache() == (not busy)

    def _abort(self, track: Track) -> None:
        self.scheduler.finish_requests(track.request_id, RequestStatus.FINISHED_ABORTED)
        track.aborted = track.done = True

    def _feed_sessions(self) -> None:
        """Send the next chunk (or the close) to sessions idling in WAITING_FOR_STREAMING_REQ, sometimes early."""
        for track in self.tracks.values():
            if not track.is_session or track.done or not track.pending:
                continue
            request = self.scheduler.requests.get(track.request_id)
            idle = request is not None and request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
            if not idle and self.rng.random() < 0.9:
                continue  # mostly wait for the chunk to finish; sometimes queue the update while it runs
            update = track.pending.popleft()
            prompt, max_tokens = update if update is not None else ([], 1)
            self.scheduler.add_request(
                self._make_request(
                    track.request_id, prompt, max_tokens, resumable=update is not None
                )
            )
            if update is None:
                track.done = track.done or idle  # closed while idle: no more output comes
            elif idle:
                self._fold(track, update)  # the scheduler applied it at once
            else:
                track.sent.append(update)  # applied when the running chunk stops

    @staticmethod
    def _fold(track: Track, update: tuple[list[int], int]) -> None:
        """Mirror the scheduler: outputs except the last sampled token fold into the prompt, then the chunk."""
        previous = track.chunks[-1]
        track.chunks.append(Chunk(previous.prompt + previous.tokens[:-1] + update[0], update[1]))

    # ------------------------------------------------------------------------------------------------ steps
    def _schedule_and_execute(self) -> None:
        if not self._scheduler_has_work():
            return
        output = self.scheduler.schedule()
        self._check_output(output)
        if self.slot_model is not None:
            self.slot_model.apply(output)
        self.in_flight.append((output, self.runner.execute_model(output)))

    def _retire_oldest(self) -> None:
        if not self.in_flight:
            return
        output, runner_output = self.in_flight.popleft()
        for engine_output in self.scheduler.update_from_output(output, runner_output):
            self._consume(engine_output)
        for request in self.scheduler.requests.values():
            assert request.num_output_placeholders >= 0 and request.async_tokens_to_discard >= 0

    def _consume(self, engine_output: EngineCoreOutput) -> None:
        track = self.tracks[engine_output.request_id]
        assert not track.done, f"output for finished request {track.request_id}"
        chunk = track.chunks[-1]
        chunk.tokens.extend(engine_output.new_token_ids)
        assert len(chunk.tokens) <= chunk.max_tokens, (
            f"{track.request_id} produced more than max_tokens"
        )
        if engine_output.finish_reason is None:
            return
        chunk.finish_reason = engine_output.finish_reason
        if not engine_output.session_continues:
            track.done = True
        elif track.sent:
            self._fold(track, track.sent.popleft())

    # ------------------------------------------------------------------------------------------------ checks
    def _check_output(self, output: SchedulerOutput) -> None:
        """Per-step invariants: slot bound and no history where the protocol does not read it."""
        scheduler = self.scheduler
        assert scheduler.num_slot_holders <= scheduler.max_num_running_reqs
        assert output.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens
        cached = output.scheduled_cached_reqs
        if self.config.use_v2_model_runner:
            assert not cached.all_token_ids, (
                "the slot runner never needs a cached request's full token list"
            )
            assert not cached.resumed_req_ids
        for new_req in output.scheduled_new_reqs:
            request = scheduler.requests[new_req.req_id]
            if new_req.prefill_token_ids is not None:
                assert request.num_preemptions > 0, "prefill_token_ids only for resumed requests"
        for index, req_id in enumerate(cached.req_ids):
            if cached.new_token_ids[index]:
                assert self.tracks[req_id].is_session, (
                    "only a session's new chunk travels as new_token_ids"
                )

    def _check_final_state(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
        assert not self.scheduler.requests, f"requests left: {list(self.scheduler.requests)}"
        assert not self.scheduler.running and not self.scheduler.waiting
        assert self.scheduler.num_waiting_for_streaming_input == 0
        # The worker hears about the last finishes on its next step: deliver them and check it is empty.
        self.runner.execute_model(self.scheduler.schedule())
        assert len(self.runner.slots.free_indices) == self.config.max_num_seqs, (
            "worker slots leaked"
        )
        for track in self.tracks.values():
            self._check_track(track)

    @staticmethod
    def _check_track(track: Track) -> None:
        for index, chunk in enumerate(track.chunks):
            expected = reference_tokens(chunk.prompt, chunk.max_tokens)
            is_last = index == len(track.chunks) - 1
            if track.aborted and is_last:
                assert chunk.tokens == expected[: len(chunk.tokens)], (
                    f"{track.request_id}: aborted output not a prefix"
                )
            else:
                assert chunk.tokens == expected, (
                    f"{track.request_id} chunk {index}: got {chunk.tokens}, expected {expected}"
                )
