"""An exhaustive interleaving checker: every sequence of engine events up to a depth, on a tiny configuration.

The randomized simulations (tests/core/test_scheduler_randomized.py, tests/engine/simulation.py,
tests/engine/engine_simulation.py) sample interleavings; this module ENUMERATES them, depth-first with state
deduplication, and checks every state it reaches.

What runs
    A real `EngineCore` (real `Scheduler` or `AsyncScheduler`, real `KVCacheManager` with prefix caching, real
    streaming sessions, real pause / resume / reset code) built on the hash model, whose executor is replaced by
    `PagedHashWorker`: a pure-Python worker for either runner protocol that keeps its own token lists and block
    tables, writes every scheduled token into a paged "KV cache" through the block table and samples the hash
    model's next token from the tokens read back, so a wrong block, prefix hit, token list or chunk changes the
    output. For the slot runner (`use_v2_model_runner=True`) the project's `WorkerSlots` model applies every step
    too. Configurations: sync and async scheduling x both runner protocols, with or without speculative decoding
    (`CheckerConfig.num_speculative_tokens`; see below).

What is enumerated (`Action`; every action enabled in a state is tried, in every order, up to `depth` actions)
    add       the next request of `CheckerConfig.requests` (fixed order; a session is a resumable request)
    chunk     a streaming session's next input chunk (applied at once when the session idles, else queued)
    step      sync: `EngineCore.step()` (schedule, run on the worker, `update_from_output`, settle a pause),
              once per outcome of the batch (`Action.outcome`, shown as `step#1`...: with drafts, every
              combination of accepted lengths); async: the engine's idle step that puts a pending pause into
              effect when nothing can run
    launch    async: the first half of `EngineCore.step_with_batch_queue`: `schedule()` and hand the batch to the
              worker (at most `batch_queue_size` = 2 in flight; while a pause is in effect, the whole `step()`),
              once per outcome of the batch, as `step`
    complete  async: the second half: the oldest batch's output is applied (`update_from_output`), then a pending
              pause settles
    abort     one live request (`abort_requests`), in whatever state it is (queued, running, in flight, idle)
    reset     `reset_prefix_cache(reset_running_requests=True)` (a forced preemption of everything running)
    pause     `pause_generation(mode, clear_cache)` for each of `CheckerConfig.pause_variants`
    resume    `resume_generation()`
    The worker runs a batch when it is launched, in launch order (as the in-process worker does): the scheduler
    cannot observe a batch's result before `complete`, and the `SchedulerOutput` is checked to be unchanged
    between launch and complete, so running it at launch or at any later point before `complete` is the same.
    A batch's outcomes are known once it runs: the search applies outcome 0 first, then adds the batch's other
    outcomes as further actions of the same state (at most `CheckerConfig.max_worker_outcomes`).

What is checked
    After every action (transition checks): each `SchedulerOutput` sent is well formed (budget, counts, protocol
    fields: no history where the protocol does not read it); the worker never runs out of slots (`WorkerSlots`
    raises "No free indices"; `PagedHashWorker` holds at most `max_num_seqs` active requests) and never gets a
    request as new while it holds it; scheduled tokens have KV blocks and every KV slot read was written; a batch's
    `SchedulerOutput` is not modified while it is in flight; every output token continues the hash-model oracle
    of its request (or session chunk), a finished one equals it, none exceeds `max_tokens`; drafts sent are at
    most k, inside the step's tokens, all ids (the worker's latest proposals) or all `DRAFT_PLACEHOLDER`s (async
    only), and a step verifying d drafts ends at its last draft and may yield 1 + d tokens within `max_tokens`
    and `max_model_len`; no KV slot of a rejected draft is read before it is written again; nothing is emitted
    while a pause is in effect, nor by requests a "wait" pause holds; a pause takes effect only with nothing in
    flight, and with `clear_cache` leaves no running request, no block in use and no cached prefix; an "abort"
    pause finishes everything.
    In every new state (state checks): the scheduler's queues partition its requests with matching statuses;
    slot holders (running + sessions keeping a slot) are within `max_num_seqs`, each holds a worker slot, and
    every other worker slot belongs to a release still to be reported; no block leaks (each block's `ref_cnt` is
    the number of live requests holding it, free iff 0, only slot holders hold blocks, and they cover the
    computed tokens); in-flight accounting is exact: for every request id, its steps in flight + step outputs
    to discard (live) or its stale placeholders (finished) equal the batches in flight that sample for it, and a
    live request's `num_output_placeholders` is 1 + d summed over its steps in flight not to be discarded (d:
    the drafts each verifies; AsyncScheduler's invariant), within `max_tokens` and `max_model_len`.
    From every new state, a drain (resume if paused, close open sessions, `step()` until idle) must end with
    nothing left anywhere (no request, block, slot, parked state, stale placeholder, batch or report), every
    finished request and session chunk equal to the oracle and every aborted one a prefix of it.

Deduplication
    A state's key is a canonical snapshot of everything that decides the future: the scheduler (requests with
    their tokens, counts and block ids, queue orders, pending reports, sessions, pause state), the block pool
    (ref counts, hashes, free-queue order), the batches in flight (what applying them reads: their scheduled
    requests and drafts, and what the worker sampled and proposed), the worker (tokens, block tables, computed
    counts, drafts, KV contents, slots) and what the checker expects (outputs so far, chunks to come). Timestamps
    and metrics are left out. A state is expanded again only when reached with more remaining depth than before.
    Snapshots are pickles of the mutable world (scheduler, batch queue, pause, worker, tracker); the core object
    itself is reused.

Speculative decoding (`num_speculative_tokens` = k > 0)
    The core gets a `speculative_config` (method "hash-oracle", read only for k: the scheduler schedules drafts,
    async draft slots and rollbacks as in production) and `PagedHashWorker` does the runner's side: it fills
    `DRAFT_PLACEHOLDER` slots with its own latest proposals, writes drafts after the known tokens, samples one
    row per draft + 1, and proposes the oracle continuation after every sampling step (`spec_token_ids`). A
    step verifying d drafts ends in any accepted length a in 0..d (the first a drafts and the oracle's next
    token; a draft the rows did not sample, e.g. padding, cannot be accepted), the KV of rejected drafts is
    poisoned, and a batch's outcomes are every combination of its requests' accepted lengths. So every output
    stays the oracle's while the scheduler sees every variable-length result, in both scheduling modes, through
    preemption, aborts, forced resets, pauses and session chunks. `SPEC_REQUESTS` are longer than the default
    requests so that k drafts fit in `max_tokens`.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from kvflow.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvflow.core.sched.output import DRAFT_PLACEHOLDER, ModelRunnerOutput
from kvflow.core.sched.scheduler import PauseState
from kvflow.engine.core import EngineCore
from kvflow.models.hash_model import DEFAULT_EOS_TOKEN_ID, next_token, reference_tokens
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.testing.spec_proposers import HASH_ORACLE_METHOD, register_hash_oracle
from kvflow.testing.worker_slots import WorkerSlots
from kvflow.utils import cdiv

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerOutput
    from kvflow.core.sched.scheduler import Scheduler
    from kvflow.engine.core import InFlightBatch

logger = logging.getLogger(__name__)

PauseVariant = tuple[str, bool]  # (mode, clear_cache)
# What the worker model leaves in the KV slot of a rejected draft: its K/V belongs to a token that is not there.
REJECTED_DRAFT = -2


# ---------------------------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class RequestSpec:
    """One request the checker may add: a prompt and its `max_tokens`; a session (`chunks` non-empty or
    `is_session`) is a resumable request whose later input chunks are `(prompt, max_tokens)` pairs."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    chunks: tuple[tuple[tuple[int, ...], int], ...] = ()
    is_session: bool = False

    @property
    def resumable(self) -> bool:
        return self.is_session or bool(self.chunks)


# Two plain requests sharing a prefix block (a prefix-cache hit) and a streaming session with a second chunk.
# "a" needs 3 blocks of 2 tokens by its last token and "b" 3 (one shared with "a"): two of them running together
# outgrow 4 blocks within three steps, so the scheduler preempts.
DEFAULT_REQUESTS = (
    RequestSpec("a", (1, 2, 3), max_tokens=3),
    RequestSpec("b", (1, 2, 4, 5), max_tokens=2),
    RequestSpec("s", (7,), max_tokens=2, chunks=(((8,), 1),)),
)
# With speculative decoding (k = 2): a request's drafts are cut to what `max_tokens` leaves after its next token,
# so these are one to two tokens longer. After its first token "a" verifies 2 drafts in one 3-token step (6 tokens:
# 3 blocks), "b" and "s" 1; "a" with "b" or "s" outgrow 4 blocks, so the scheduler preempts with drafts in flight.
SPEC_REQUESTS = (
    RequestSpec("a", (1, 2, 3), max_tokens=4),
    RequestSpec("b", (1, 2, 4, 5), max_tokens=3),
    RequestSpec("s", (7,), max_tokens=3, chunks=(((8,), 1),)),
)
# Every pause mode. ("keep", True) is left out by default: it is ("keep", False) followed by a forced reset once
# nothing is in flight, which the search reaches one action deeper; `ALL_PAUSE_VARIANTS` has it too.
DEFAULT_PAUSE_VARIANTS: tuple[PauseVariant, ...] = (
    ("abort", False),
    ("wait", True),
    ("keep", False),
)
ALL_PAUSE_VARIANTS: tuple[PauseVariant, ...] = (*DEFAULT_PAUSE_VARIANTS, ("keep", True))


@dataclass(frozen=True)
class CheckerConfig:
    """The engine configuration, the requests and the search bounds of one exhaustive run.

    `depth` bounds the number of actions before the drain; `max_states` stops a search that grew past what the
    caller budgets (the result says so: `SearchResult.complete` is False). `num_speculative_tokens` (k) turns
    speculative decoding on; `max_worker_outcomes` bounds a batch's outcomes (a batch with more is a ValueError,
    never a silent cut): (k + 1) ** max_num_seqs covers every combination of accepted lengths.
    """

    async_scheduling: bool = False
    use_v2_model_runner: bool = True
    num_speculative_tokens: int = 0
    max_num_seqs: int = 2
    num_blocks: int = 4
    block_size: int = 2
    max_num_batched_tokens: int = 3
    max_model_len: int = 8
    enable_prefix_caching: bool = True
    requests: tuple[RequestSpec, ...] = DEFAULT_REQUESTS
    pause_variants: tuple[PauseVariant, ...] = DEFAULT_PAUSE_VARIANTS
    depth: int = 8
    max_states: int | None = None
    max_worker_outcomes: int = 1
    max_drain_steps: int = 200

    @property
    def name(self) -> str:
        mode = "async" if self.async_scheduling else "sync"
        protocol = "slot" if self.use_v2_model_runner else "persistent_batch"
        drafts = f"/k={self.num_speculative_tokens}" if self.num_speculative_tokens else ""
        return f"{mode}/{protocol}{drafts}/depth={self.depth}"


@dataclass(frozen=True)
class Action:
    """One enumerated event: `kind` (see the module docstring), `arg` (a request id or a pause variant) and, for
    the actions that run a batch on the worker, the index of the worker's outcome."""

    kind: str
    arg: Any = None
    outcome: int = 0

    def __str__(self) -> str:
        text = self.kind if self.arg is None else f"{self.kind}({self.arg})"
        return text if not self.outcome else f"{text}#{self.outcome}"


class InterleavingViolation(AssertionError):
    """An invariant failed: `trace` is the sequence of actions that led there (`+ drain` if in the drain)."""

    def __init__(self, message: str, trace: list[Action], in_drain: bool = False) -> None:
        self.message = message
        self.trace = list(trace)
        self.in_drain = in_drain
        where = " + drain" if in_drain else ""
        super().__init__(f"{message}\n  after: {' '.join(map(str, trace)) or '(start)'}{where}")


class _NotApplicable(Exception):
    """The action's outcome index is beyond what the worker can produce for this batch: not a real branch."""


@dataclass
class SearchResult:
    """What a search covered.

    `num_states`: distinct states reached; `num_interleavings`: distinct action sequences of length 1..depth
    (each followed by a drain from its end state); `num_transitions`: actions executed (the rest of the
    interleavings reach a state already checked); `coverage`: executed actions by (kind, batches in flight
    before it); `events`: transitions in which something worth covering happened ("preempted_in_step": the
    scheduler preempted for KV blocks, "prefix_hit": a request was admitted with cached blocks,
    "dropped_in_flight": a stale in-flight output of a preempted or stopped request was dropped, "session_chunk":
    a session went on with its next chunk; with drafts: "verified_drafts" / "rejected_drafts": a batch verified
    drafts / rejected some, "placeholder_drafts": its draft slots were placeholders the worker filled,
    "padded_drafts": the worker had fewer drafts than slots, "dropped_draft_step": a stale in-flight step that
    verified drafts was dropped); `max_outcomes`: the most outcomes a batch had.
    """

    config: CheckerConfig
    num_states: int = 0
    num_interleavings: int = 0
    num_transitions: int = 0
    num_drains: int = 0
    num_drain_steps: int = 0
    elapsed_s: float = 0.0
    complete: bool = True
    max_outcomes: int = 1
    coverage: Counter[tuple[str, int]] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        return (
            f"{self.config.name}: {self.num_states} states, {self.num_interleavings} interleavings, "
            f"{self.num_transitions} transitions, {self.num_drains} drains "
            f"({self.num_drain_steps} drain steps) in {self.elapsed_s:.1f}s"
            + ("" if self.complete else " (stopped at max_states)")
        )


@lru_cache(maxsize=4096)
def _oracle(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(reference_tokens(prompt, max_tokens))


# ---------------------------------------------------------------------------------------------------- worker model
class PagedHashWorker:
    """A pure-Python worker for either runner protocol, running the hash model on a paged KV cache.

    It applies each `SchedulerOutput` as the runner does: release `finished_req_ids | preempted_req_ids` (the
    persistent-batch protocol parks a preempted request's tokens), add `scheduled_new_reqs`, update
    `scheduled_cached_reqs` (new blocks, a session's chunk, a persistent-batch resume with its replacement block
    table and `all_token_ids`; with speculation, a computed count that is the lower of the scheduler's and its own,
    as the runner's min rule); then it writes the scheduled tokens (and drafts) through the block table and samples
    `next_token(tokens read back)` for each request that reached the end of its tokens, appending what it keeps to
    its own list (so the next step can run before the scheduler has the tokens: async scheduling).

    Speculative decoding (`num_speculative_tokens` > 0): the drafts a step verifies are the scheduler's, its
    `DRAFT_PLACEHOLDER` slots filled with the worker's own latest proposals (padded with token 0 where it has
    fewer); they are written after the known tokens, and row j of the request samples after the first j of them.
    Draft j can be accepted only if rows 0..j sampled drafts 0..j (`m` drafts at most); the batch's outcomes are
    every combination of accepted lengths `a` in m..0 (index 0: greedy, all it can), and a request accepting `a`
    yields its rows 0..a. The KV slots of its rejected drafts are marked `REJECTED_DRAFT` (a stale draft's K/V:
    reading one is a violation) and its computed count rolls back over them. After sampling, each request that
    sampled proposes the oracle continuation of its tokens (up to k, never past `max_model_len`), returned in
    `spec_token_ids`, so accepting drafts keeps every output the oracle's.

    Invariants: `len(tokens) <= max_num_reqs` (a request with `tokens` holds a slot; parked ones hold none); a
    request is never both active and parked; `drafts` only for active requests; `last_scheduled_ids` is the
    previous step's scheduled requests.
    """

    def __init__(
        self,
        max_num_reqs: int,
        block_size: int,
        num_blocks: int,
        use_v2_model_runner: bool,
        max_model_len: int,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.use_v2_model_runner = use_v2_model_runner
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.kv: list[int | None] = [None] * (block_size * num_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.block_table: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        # Each request's proposals after its latest sampling step.
        self.drafts: dict[str, list[int]] = {}
        self.parked: dict[str, list[int]] = {}
        self.last_scheduled_ids: frozenset[str] = frozenset()
        # The last batch run: its number of outcomes, and what happened worth covering (`SearchResult.events`).
        self.num_outcomes = 1
        self.step_events: list[str] = []

    @property
    def held(self) -> set[str]:
        """Requests holding a worker slot."""
        return set(self.tokens)

    def execute(
        self, scheduler_output: SchedulerOutput, outcome_index: int = 0
    ) -> ModelRunnerOutput:
        """Run a batch with its outcome number `outcome_index` (of `num_outcomes`, set by this call; raises
        `_NotApplicable` past them)."""
        self.step_events = []
        self._release(scheduler_output)
        self._add_new(scheduler_output)
        self._update_cached(scheduler_output)
        assert len(self.tokens) <= self.max_num_reqs, (
            f"the worker ran out of slots: {sorted(self.tokens)} > max_num_seqs={self.max_num_reqs}"
        )
        self.last_scheduled_ids = frozenset(scheduler_output.num_scheduled_tokens)
        return self._run(scheduler_output, outcome_index)

    def _drop(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)
        self.block_table.pop(req_id, None)
        self.computed.pop(req_id, None)
        self.drafts.pop(req_id, None)

    def _release(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._drop(req_id)
            self.parked.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids - scheduler_output.finished_req_ids:
            if not self.use_v2_model_runner and req_id in self.tokens:
                self.parked[req_id] = self.tokens[req_id]
            self._drop(req_id)

    def _add_new(self, scheduler_output: SchedulerOutput) -> None:
        for new_req in scheduler_output.scheduled_new_reqs:
            req_id = new_req.req_id
            assert req_id not in self.tokens, f"{req_id!r} sent as new while it holds a worker slot"
            self.parked.pop(req_id, None)
            token_ids = (
                new_req.prefill_token_ids
                if new_req.prefill_token_ids is not None
                else new_req.prompt_token_ids
            )
            self.tokens[req_id] = list(token_ids)
            self.block_table[req_id] = list(new_req.block_ids[0])
            self.computed[req_id] = new_req.num_computed_tokens

    def _update_cached(self, scheduler_output: SchedulerOutput) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            num_computed = cached.num_computed_tokens[index]
            new_block_ids = cached.new_block_ids[index]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                assert not self.use_v2_model_runner, "the slot runner gets resumes as new requests"
                assert new_block_ids is not None, f"resumed {req_id!r} without a block table"
                if req_id in self.parked:
                    self.tokens[req_id] = self.parked.pop(req_id)
                assert req_id in self.tokens, f"resumed {req_id!r} is unknown to the worker"
                self.block_table[req_id] = list(new_block_ids[0])
            else:
                assert req_id not in self.parked, f"parked {req_id!r} scheduled without a resume"
                assert req_id in self.tokens, f"cached request {req_id!r} holds no worker slot"
                if new_block_ids is not None:
                    self.block_table[req_id].extend(new_block_ids[0])
            if req_id in cached.all_token_ids:
                self.tokens[req_id] = list(cached.all_token_ids[req_id])
            elif cached.new_token_ids[index]:
                assert num_computed <= len(self.tokens[req_id]), (
                    f"{req_id!r}: a chunk written past the worker's tokens"
                )
                self.tokens[req_id] = self.tokens[req_id][:num_computed] + list(
                    cached.new_token_ids[index]
                )
            if self.num_speculative_tokens and not resumed:
                # The scheduler's count takes the draft slots of steps in flight as accepted (an upper bound).
                num_computed = min(num_computed, self.computed[req_id])
            self.computed[req_id] = num_computed

    def _run(self, scheduler_output: SchedulerOutput, outcome_index: int) -> ModelRunnerOutput:
        """Write every scheduled token and draft, sample each request's rows, then apply the chosen outcome."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        drafts: dict[str, list[int]] = {}
        # Requests whose draft slots were placeholders -> how many the worker filled with its own drafts.
        num_real_drafts: dict[str, int] = {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            drafts[req_id] = self._fill_drafts(
                req_id, scheduled_drafts.get(req_id), num_real_drafts
            )
            self._write(req_id, num_tokens, drafts[req_id])
        rows = {  # what each request that reached the end of its tokens samples (a partial prefill: nothing)
            req_id: self._sample_rows(req_id, len(drafts[req_id]))
            for req_id in req_ids
            if self.computed[req_id] >= len(self.tokens[req_id])
        }
        verifying = [req_id for req_id in rows if drafts[req_id]]
        outcomes = list(
            itertools.product(
                *(range(_num_matching(rows[r], drafts[r]), -1, -1) for r in verifying)
            )
        )
        self.num_outcomes = len(outcomes)
        if outcome_index >= len(outcomes):
            raise _NotApplicable
        accepted = dict(zip(verifying, outcomes[outcome_index], strict=True))
        sampled: list[list[int]] = []
        proposals: list[list[int]] = []
        for req_id in req_ids:
            if req_id not in rows:
                sampled.append([])
                proposals.append([])
                continue
            generated = rows[req_id][: accepted.get(req_id, 0) + 1]
            self._accept(req_id, drafts[req_id], generated)
            sampled.append(generated)
            proposals.append(self._propose(req_id))
        if verifying:
            self.step_events.append("verified_drafts")
        if any(accepted[req_id] < len(drafts[req_id]) for req_id in verifying):
            self.step_events.append("rejected_drafts")
        output = ModelRunnerOutput(
            req_ids, {req_id: i for i, req_id in enumerate(req_ids)}, sampled
        )
        if self.num_speculative_tokens:
            output.spec_token_ids = proposals
            if num_real_drafts:
                output.num_real_drafts = [
                    num_real_drafts.get(req_id, len(drafts[req_id])) for req_id in req_ids
                ]
        return output

    def _fill_drafts(
        self, req_id: str, scheduled: list[int] | None, num_real_drafts: dict[str, int]
    ) -> list[int]:
        """The drafts a step verifies: the scheduler's, or for `DRAFT_PLACEHOLDER` slots the worker's own."""
        if not scheduled:
            return []
        if DRAFT_PLACEHOLDER not in scheduled:
            latest = self.drafts.get(req_id, [])
            assert list(scheduled) == latest[: len(scheduled)], (
                f"{req_id!r}: drafts {scheduled} are not the worker's latest proposals {latest}"
            )
            return list(scheduled)
        self.step_events.append("placeholder_drafts")
        own = self.drafts.get(req_id, [])[: len(scheduled)]
        num_real_drafts[req_id] = len(own)
        if len(own) < len(scheduled):
            self.step_events.append("padded_drafts")
        return own + [0] * (len(scheduled) - len(own))

    def _write(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Write the scheduled positions (known tokens, then drafts) into the KV cache."""
        start = self.computed[req_id]
        end = start + num_tokens
        readable = self.tokens[req_id] + drafts
        table = self.block_table[req_id]
        assert end <= len(readable), f"{req_id!r}: scheduled past the worker's tokens ({end})"
        assert not drafts or end == len(readable), (
            f"{req_id!r}: a step verifying {len(drafts)} drafts ends at {end}, not at its last draft"
        )
        assert cdiv(end, self.block_size) <= len(table), f"{req_id!r}: tokens without KV blocks"
        for position in range(start, end):
            self.kv[self._slot(table, position)] = readable[position]
        self.computed[req_id] = end

    def _sample_rows(self, req_id: str, num_drafts: int) -> list[int]:
        """Row j samples after the known tokens and the first j drafts, read back through the block table."""
        table = self.block_table[req_id]
        read_back = [
            self.kv[self._slot(table, position)]
            for position in range(len(self.tokens[req_id]) + num_drafts)
        ]
        assert None not in read_back, f"{req_id!r}: read a KV slot that was never written"
        assert REJECTED_DRAFT not in read_back, f"{req_id!r}: read the KV of a rejected draft"
        num_known = len(self.tokens[req_id])
        return [next_token(read_back[: num_known + j]) for j in range(num_drafts + 1)]  # type: ignore[arg-type]

    def _accept(self, req_id: str, drafts: list[int], generated: list[int]) -> None:
        """Keep the accepted drafts and the token after them; roll back over the rejected drafts."""
        tokens = self.tokens[req_id]
        num_known = len(tokens)
        num_rejected = len(drafts) + 1 - len(generated)
        if num_rejected:
            table = self.block_table[req_id]
            for position in range(num_known + len(generated) - 1, num_known + len(drafts)):
                self.kv[self._slot(table, position)] = REJECTED_DRAFT
            self.computed[req_id] -= num_rejected
        tokens.extend(generated[: max(self.max_model_len - num_known, 0)])  # past it: reported only

    def _propose(self, req_id: str) -> list[int]:
        """The oracle continuation of the request's tokens, up to k, never reaching past `max_model_len`."""
        if not self.num_speculative_tokens:
            return []
        tokens = self.tokens[req_id]
        room = self.max_model_len - len(tokens) - 1
        proposals = (
            list(_oracle(tuple(tokens), min(self.num_speculative_tokens, room))) if room > 0 else []
        )
        self.drafts[req_id] = proposals
        return proposals

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def state_key(self) -> tuple[Any, ...]:
        active = tuple(
            (
                req_id,
                tuple(self.tokens[req_id]),
                tuple(self.block_table[req_id]),
                self.computed[req_id],
                tuple(self.drafts.get(req_id, ())),
            )
            for req_id in sorted(self.tokens)
        )
        parked = tuple((req_id, tuple(tokens)) for req_id, tokens in sorted(self.parked.items()))
        return active, parked, tuple(self.kv), frozenset(self.last_scheduled_ids)


def _num_matching(rows: list[int], drafts: list[int]) -> int:
    """How many leading drafts the rows sampled: the most a step can accept (greedy accepts exactly these)."""
    num_matching = 0
    while num_matching < len(drafts) and rows[num_matching] == drafts[num_matching]:
        num_matching += 1
    return num_matching


class _FinishedStep:
    """The future of a batch the worker already ran: `result()` hands its output over, after checking that the
    batch's `SchedulerOutput` was not modified while it was in flight (the worker may read it any time)."""

    def __init__(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        self.scheduler_output = scheduler_output
        self.model_runner_output = model_runner_output
        self.fingerprint = hash(_output_key(scheduler_output))
        spec_token_ids = model_runner_output.spec_token_ids
        num_real_drafts = model_runner_output.num_real_drafts
        self.result_key = (
            tuple(map(tuple, model_runner_output.sampled_token_ids)),
            None if spec_token_ids is None else tuple(map(tuple, spec_token_ids)),
            None if num_real_drafts is None else tuple(num_real_drafts),
        )

    def result(self) -> ModelRunnerOutput:
        assert hash(_output_key(self.scheduler_output)) == self.fingerprint, (
            "a SchedulerOutput was modified while its batch was in flight"
        )
        return self.model_runner_output


class _CheckerExecutor:
    """Stands in for the engine core's executor: checks each batch as it goes out, then runs it on the world's
    `PagedHashWorker` (and `WorkerSlots`) with the outcome the current action chose."""

    num_kv_blocks: int

    def __init__(self, world: _World) -> None:
        self.world = world
        self.outcome_index = 0

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        model_runner_output = self.world.run_on_worker(scheduler_output, self.outcome_index)
        return (
            _FinishedStep(scheduler_output, model_runner_output)
            if non_block
            else model_runner_output
        )

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- expectations
@dataclass
class _Chunk:
    """One generation round of a request (a session's chunk): the prompt it ran on (folded) and its tokens."""

    prompt: tuple[int, ...]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def key(self) -> tuple[Any, ...]:
        return self.prompt, self.max_tokens, tuple(self.tokens), self.finish_reason


@dataclass
class _Track:
    """What the checker expects of one added request. Invariant: `chunks[-1]` is the round that runs now;
    `unfed` are session chunks not sent yet, `sent` those sent while a round ran (applied when it stops)."""

    request_id: str
    is_session: bool
    chunks: list[_Chunk]
    unfed: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    sent: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    closing: bool = False
    aborted: bool = False
    done: bool = False

    def key(self) -> tuple[Any, ...]:
        return (
            self.request_id,
            tuple(chunk.key() for chunk in self.chunks),
            tuple(self.unfed),
            tuple(self.sent),
            self.closing,
            self.aborted,
            self.done,
        )

    def fold(self, update: tuple[tuple[int, ...], int]) -> None:
        """Mirror the scheduler: a round's outputs except the last sampled token fold into the prompt."""
        previous = self.chunks[-1]
        prompt = previous.prompt + tuple(previous.tokens[:-1]) + update[0]
        self.chunks.append(_Chunk(prompt, update[1]))


@dataclass
class _Tracker:
    """The checker's expectations: added requests, the next to add, and the requests a "wait" pause holds.

    Invariant: a track is `done` exactly when its request left the scheduler (finished, aborted or closed).
    """

    tracks: dict[str, _Track] = field(default_factory=dict)
    num_added: int = 0
    held_by_wait: frozenset[str] | None = None  # None: no "wait" pause

    def key(self) -> tuple[Any, ...]:
        return (
            tuple(track.key() for track in self.tracks.values()),
            self.num_added,
            self.held_by_wait,
        )

    def live(self) -> list[_Track]:
        return [track for track in self.tracks.values() if not track.done]

    def consume(self, output: EngineCoreOutput, frozen: bool) -> None:
        track = self.tracks.get(output.request_id)
        assert track is not None and not track.done, f"output for a finished request: {output}"
        if frozen:
            assert not output.new_token_ids, f"tokens emitted while a pause is in effect: {output}"
        if self.held_by_wait is not None and output.request_id in self.held_by_wait:
            assert not output.new_token_ids, f"a request held by a wait pause ran: {output}"
        chunk = track.chunks[-1]
        chunk.tokens.extend(output.new_token_ids)
        expected = _oracle(chunk.prompt, chunk.max_tokens)
        assert tuple(chunk.tokens) == expected[: len(chunk.tokens)], (
            f"{output.request_id}: tokens {chunk.tokens} do not continue the oracle {list(expected)}"
        )
        assert len(chunk.tokens) <= chunk.max_tokens, f"{output.request_id}: past max_tokens"
        if output.finish_reason is None:
            return
        chunk.finish_reason = output.finish_reason
        if output.finish_reason == "abort":
            track.aborted = True
        else:
            assert output.finish_reason == "length", f"unexpected finish: {output}"
            assert tuple(chunk.tokens) == expected, (
                f"{output.request_id} finished with {chunk.tokens}, expected {list(expected)}"
            )
        if not output.session_continues:
            track.done = True
        elif track.sent:
            track.fold(track.sent.pop(0))


# ---------------------------------------------------------------------------------------------------- the world
def _make_engine_core(config: CheckerConfig) -> EngineCore:
    """A real engine core on the hash model (its executor is replaced by the world's `_CheckerExecutor`)."""
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


class _World:
    """The engine core, the worker model and the checker's expectations, driven one `Action` at a time.

    `snapshot()` / `restore()` save and bring back everything mutable (the core object itself is reused: its
    scheduler, batch queue and pause are swapped in). `key()` is the canonical state (see the module docstring).
    """

    def __init__(self, config: CheckerConfig) -> None:
        self.config = config
        self.specs = {spec.request_id: spec for spec in config.requests}
        self.core = _make_engine_core(config)
        real_executor = self.core.executor
        self.executor = _CheckerExecutor(self)
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
        self.tracker = _Tracker()
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
                _scheduler_key(core.scheduler),
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
        """Run one action and its transition checks (AssertionError on a violation; `_NotApplicable` when the
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
                self._check_pause_took_effect()

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
            _make_request(spec.request_id, spec.prompt, spec.max_tokens, spec.resumable)
        )
        tracker.tracks[spec.request_id] = _Track(
            spec.request_id,
            spec.resumable,
            [_Chunk(spec.prompt, spec.max_tokens)],
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
        self.core.add_request(_make_request(track.request_id, update[0], update[1], True))
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
        self._check_sent(scheduler_output)
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

    def _check_sent(self, output: SchedulerOutput) -> None:
        scheduler = self.scheduler
        scheduled = output.num_scheduled_tokens
        assert scheduler.num_slot_holders <= scheduler.max_num_running_reqs, (
            "slot holders over max_num_seqs"
        )
        assert output.total_num_scheduled_tokens == sum(scheduled.values())
        assert output.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens, (
            "over the budget"
        )
        assert all(num_tokens > 0 for num_tokens in scheduled.values()), scheduled
        cached = output.scheduled_cached_reqs
        new_ids = [new_req.req_id for new_req in output.scheduled_new_reqs]
        assert sorted(new_ids + cached.req_ids) == sorted(scheduled), "new + cached != scheduled"
        for new_req in output.scheduled_new_reqs:
            if new_req.prefill_token_ids is not None:
                assert scheduler.requests[new_req.req_id].num_preemptions > 0, (
                    "prefill for a fresh request"
                )
        if self.config.use_v2_model_runner:
            assert not cached.all_token_ids, "the slot runner never reads all_token_ids"
            assert not cached.resumed_req_ids, "the slot runner gets resumes as new requests"
        else:
            for req_id in cached.all_token_ids:
                assert (
                    req_id in cached.resumed_req_ids or req_id not in self.worker.last_scheduled_ids
                ), f"redundant all_token_ids for {req_id!r}: the worker ran it in the previous step"
        for index, req_id in enumerate(cached.req_ids):
            if cached.new_token_ids[index]:
                assert self.tracker.tracks[req_id].is_session, (
                    "only a session's chunk travels as new tokens"
                )
        for req_id, drafts in output.scheduled_spec_decode_tokens.items():
            self._check_sent_drafts(req_id, drafts, scheduled.get(req_id, 0))

    def _check_sent_drafts(self, req_id: str, drafts: list[int], num_scheduled: int) -> None:
        """A step verifying drafts: at most k of them, all ids or (async) all placeholders, inside the step's
        tokens, and the most it can yield within `max_tokens` and `max_model_len` (async: the request's
        placeholders, this step's included, bound what its steps in flight can yield)."""
        config = self.config
        assert 0 < len(drafts) <= config.num_speculative_tokens, f"{req_id!r}: drafts {drafts}"
        assert len(drafts) < num_scheduled, (
            f"{req_id!r}: {len(drafts)} drafts in {num_scheduled} tokens"
        )
        num_placeholders = drafts.count(DRAFT_PLACEHOLDER)
        assert num_placeholders in (0, len(drafts)), (
            f"{req_id!r}: drafts {drafts} mix ids and slots"
        )
        assert config.async_scheduling or not num_placeholders, "draft slots in sync scheduling"
        request = self.scheduler.requests[req_id]
        most_yield = request.num_output_placeholders if config.async_scheduling else 1 + len(drafts)
        assert request.num_output_tokens + most_yield <= request.max_tokens, (
            f"{req_id!r}: a step with {len(drafts)} drafts may pass max_tokens"
        )
        assert request.num_tokens + most_yield <= config.max_model_len, (
            f"{req_id!r}: a step with {len(drafts)} drafts may pass max_model_len"
        )

    # ------------------------------------------------------------------------------------------------ state checks
    def check_state(self) -> None:
        """The invariants of a state (see the module docstring)."""
        self._check_queues()
        self._check_slots()
        self._check_blocks()
        self._check_in_flight_accounting()
        self._check_pause_state()

    def _check_queues(self) -> None:
        scheduler, tracker = self.scheduler, self.tracker
        running = [request.request_id for request in scheduler.running]
        waiting = [request.request_id for request in scheduler.waiting]
        idle = [
            request_id
            for request_id, request in scheduler.requests.items()
            if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
        ]
        assert sorted(running + waiting + idle) == sorted(scheduler.requests), (
            f"queues {running} + {waiting} + idle {idle} do not partition {sorted(scheduler.requests)}"
        )
        assert all(
            scheduler.requests[request_id].status == RequestStatus.RUNNING for request_id in running
        )
        waiting_statuses = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert all(
            scheduler.requests[request_id].status in waiting_statuses for request_id in waiting
        )
        assert scheduler.num_waiting_for_streaming_input == len(idle)
        assert set(scheduler.requests) == {track.request_id for track in tracker.live()}, (
            f"scheduler requests {sorted(scheduler.requests)} != live tracks"
        )

    def _slot_holders(self) -> set[str]:
        scheduler = self.scheduler
        holders = {request.request_id for request in scheduler.running}
        holders |= {
            request_id
            for request_id in scheduler.requests
            if scheduler.sessions.holds_slot(request_id)
        }
        return holders

    def _check_slots(self) -> None:
        scheduler = self.scheduler
        holders = self._slot_holders()
        assert len(holders) == scheduler.num_slot_holders <= scheduler.max_num_running_reqs, (
            f"slot holders {sorted(holders)}"
        )
        held = self.worker.held
        pending = scheduler.finished_req_ids | scheduler.reset_preempted_req_ids
        assert holders <= held, f"slot holders {sorted(holders - held)} hold no worker slot"
        assert held - holders <= pending, (
            f"worker slots {sorted(held - holders - pending)} are held by no one and not reported"
        )
        if self.slots is not None:
            assert self.slots.held == held, (
                f"WorkerSlots {sorted(self.slots.held)} != worker {sorted(held)}"
            )

    def _check_blocks(self) -> None:
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        holders = self._slot_holders()
        ref_counts: Counter[int] = Counter()
        for request_id, request_blocks in manager.req_to_blocks.items():
            assert request_id in holders, f"{request_id!r} holds KV blocks without holding a slot"
            ref_counts.update(block.block_id for block in request_blocks.blocks)
            request = scheduler.requests[request_id]
            num_positions = len(request_blocks.blocks) * self.config.block_size
            assert request.num_computed_tokens <= num_positions, (
                f"{request_id!r}: computed past its blocks"
            )
        for block in pool.blocks:
            assert block.ref_cnt == ref_counts[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held {ref_counts[block.block_id]} times"
            )
        num_in_use = sum(1 for block in pool.blocks if block.ref_cnt)
        assert pool.get_num_free_blocks() + num_in_use == pool.num_blocks, (
            "the free queue lost blocks"
        )
        for request_id, request in scheduler.requests.items():
            if request_id not in manager.req_to_blocks:
                assert request.num_computed_tokens == 0, (
                    f"{request_id!r}: computed tokens without blocks"
                )

    def _check_in_flight_accounting(self) -> None:
        """For every id: steps in flight + step outputs to discard (live) or stale placeholders (finished) equal
        the batches in flight that sample for it; a live request's placeholders are the most its steps in flight
        that are not to be discarded (the newest ones) can yield: 1 + d for a step verifying d drafts."""
        scheduler = self.scheduler
        # Request id -> the drafts verified by each batch in flight that samples for it, oldest first.
        in_flight: dict[str, list[int]] = {}
        for batch in self.core.batch_queue:
            model_runner_output = batch.future.model_runner_output  # type: ignore[attr-defined]
            drafts = batch.scheduler_output.scheduled_spec_decode_tokens
            for req_id, index in model_runner_output.req_id_to_index.items():
                if model_runner_output.sampled_token_ids[index]:
                    in_flight.setdefault(req_id, []).append(len(drafts.get(req_id, ())))
        stale = getattr(scheduler, "_stale_placeholders", {})
        for req_id in set(in_flight) | set(scheduler.requests) | set(stale):
            steps = in_flight.get(req_id, [])
            request = scheduler.requests.get(req_id)
            if request is not None:
                num_steps = request.num_in_flight_steps
                assert 0 <= num_steps <= request.num_output_placeholders, request
                assert request.async_tokens_to_discard >= 0, request
                counted = num_steps + request.async_tokens_to_discard
            else:
                counted = stale.get(req_id, 0)
            assert counted == len(steps), (
                f"{req_id!r}: {counted} step outputs counted in flight (steps + discards), "
                f"{len(steps)} batches in flight sample for it"
            )
            if request is not None:
                live_steps = steps[request.async_tokens_to_discard :]
                most_yield = sum(1 + num_drafts for num_drafts in live_steps)
                assert request.num_output_placeholders == most_yield, (
                    f"{req_id!r}: {request.num_output_placeholders} placeholders, its steps in flight "
                    f"verifying {live_steps} drafts may yield {most_yield} tokens"
                )
                assert request.num_output_tokens + most_yield <= request.max_tokens, (
                    f"{req_id!r}: its steps in flight may pass max_tokens"
                )
                assert request.num_tokens + most_yield <= self.config.max_model_len, (
                    f"{req_id!r}: its steps in flight may pass max_model_len"
                )

    def _check_pause_state(self) -> None:
        core = self.core
        expected = PauseState.UNPAUSED if core.pause is None else core.pause.scheduler_state
        assert self.scheduler.pause_state == expected, (
            "the scheduler's pause state disagrees with the core"
        )

    def _check_pause_took_effect(self) -> None:
        pause = self.core.pause
        assert pause is not None
        if pause.clear_cache:
            pool = self.scheduler.kv_cache_manager.block_pool
            assert not self.scheduler.running, "clear_cache left running requests"
            assert pool.get_num_free_blocks() == pool.num_blocks, (
                "clear_cache left KV blocks in use"
            )
            assert not pool.cached_block_hash_to_block, "clear_cache left cached prefixes"

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
                self._check_clean()
                break
            for output in core.step():
                tracker.consume(output, frozen=False)
        else:
            raise AssertionError(
                f"the engine did not go idle in {self.config.max_drain_steps} steps"
            )
        drained_ok.update(passed)
        return num_steps if touched or passed else None

    def _check_clean(self) -> None:
        core, scheduler = self.core, self.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        assert not core.batch_queue and not scheduler.has_pending_reports()
        assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
        assert not scheduler.requests and not scheduler.running and not scheduler.waiting
        assert not getattr(scheduler, "_stale_placeholders", {}), "stale placeholders left"
        assert not self.worker.tokens and not self.worker.parked, "worker state leaked"
        if self.slots is not None:
            assert not self.slots.held, "WorkerSlots still held"
        for track in self.tracker.tracks.values():
            assert track.done, f"{track.request_id} never finished"
            for index, chunk in enumerate(track.chunks):
                expected = _oracle(chunk.prompt, chunk.max_tokens)
                if track.aborted and index == len(track.chunks) - 1:
                    assert tuple(chunk.tokens) == expected[: len(chunk.tokens)]
                else:
                    assert tuple(chunk.tokens) == expected, (
                        f"{track.request_id} round {index}: {chunk.tokens} != {list(expected)}"
                    )


def _make_request(
    request_id: str, prompt: tuple[int, ...], max_tokens: int, resumable: bool
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id, list(prompt), params, eos_token_id=DEFAULT_EOS_TOKEN_ID, resumable=resumable
    )


# ---------------------------------------------------------------------------------------------------- canonical keys
def _output_key(output: SchedulerOutput) -> tuple[Any, ...]:
    """Everything a `SchedulerOutput` tells the worker, as a hashable value."""
    cached = output.scheduled_cached_reqs
    new_reqs = tuple(
        (
            new_req.req_id,
            tuple(new_req.prompt_token_ids),
            tuple(map(tuple, new_req.block_ids)),
            new_req.num_computed_tokens,
            None if new_req.prefill_token_ids is None else tuple(new_req.prefill_token_ids),
            new_req.sampling_params.max_tokens,
        )
        for new_req in output.scheduled_new_reqs
    )
    cached_reqs = (
        tuple(cached.req_ids),
        frozenset(cached.resumed_req_ids),
        tuple(map(tuple, cached.new_token_ids)),
        frozenset((req_id, tuple(ids)) for req_id, ids in cached.all_token_ids.items()),
        tuple(None if ids is None else tuple(map(tuple, ids)) for ids in cached.new_block_ids),
        tuple(cached.num_computed_tokens),
        tuple(cached.num_output_tokens),
    )
    return (
        tuple(output.num_scheduled_tokens.items()),
        new_reqs,
        cached_reqs,
        frozenset(
            (req_id, tuple(ids)) for req_id, ids in output.scheduled_spec_decode_tokens.items()
        ),
        frozenset(output.finished_req_ids),
        frozenset(output.preempted_req_ids),
    )


def _request_key(request: Request, scheduler: Scheduler) -> tuple[Any, ...]:
    request_blocks = scheduler.kv_cache_manager.req_to_blocks.get(request.request_id)
    blocks = (
        None
        if request_blocks is None
        else (
            tuple(block.block_id for block in request_blocks.blocks),
            request_blocks.num_cached_blocks,
        )
    )
    queue = request.streaming_queue
    return (
        request.request_id,
        int(request.status),
        tuple(request.prompt_token_ids),
        tuple(request.output_token_ids),
        request.num_computed_tokens,
        request.num_output_placeholders,
        request.num_in_flight_steps,
        request.async_tokens_to_discard,
        request.num_preemptions > 0,
        request.sampling_params.max_tokens,
        request.resumable,
        None
        if queue is None
        else tuple(
            None
            if update is None
            else (tuple(update.prompt_token_ids), update.sampling_params.max_tokens)
            for update in queue
        ),
        tuple(request.spec_token_ids),
        request.num_last_proposed_drafts,  # async draft slots follow the worker's latest proposals
        len(request.block_hashes),
        blocks,
    )


def _scheduler_key(scheduler: Scheduler) -> tuple[Any, ...]:
    pool = scheduler.kv_cache_manager.block_pool
    sessions = scheduler.sessions
    return (
        tuple(
            _request_key(request, scheduler) for _, request in sorted(scheduler.requests.items())
        ),
        tuple(request.request_id for request in scheduler.running),
        tuple(request.request_id for request in scheduler.waiting),
        frozenset(scheduler.finished_req_ids),
        frozenset(scheduler.reset_preempted_req_ids),
        frozenset(scheduler.prev_step_scheduled_req_ids),
        frozenset(getattr(scheduler, "_stale_placeholders", {}).items()),
        frozenset(sessions._idle_ids),
        frozenset(sessions._slot_holders),
        frozenset(sessions._unsent_chunk_ids),
        scheduler.pause_state.value,
        tuple((block.ref_cnt, block.block_hash) for block in pool.blocks),
        tuple(block.block_id for block in pool.free_block_queue.get_all_free_blocks()),
    )


# ---------------------------------------------------------------------------------------------------- search
class _Search:
    """Depth-first enumeration with deduplication. `best_remaining[key]` is the most remaining depth a state was
    expanded with (it is expanded again only with more); `children[key]` its successors, in action order."""

    def __init__(self, config: CheckerConfig) -> None:
        self.config = config
        self.world = _World(config)
        self.result = SearchResult(config)
        self.best_remaining: dict[int, int] = {}
        self.children: dict[int, list[int]] = {}
        self.drained_ok: set[int] = set()
        self.trace: list[Action] = []

    def run(self) -> SearchResult:
        start = time.perf_counter()
        world = self.world
        root = world.key()
        self._explore(root, *self._visit_new(root), self.config.depth)
        result = self.result
        result.num_states = len(self.best_remaining)
        result.events = world.events
        result.num_interleavings = self._count_interleavings(root, self.config.depth) - 1
        result.elapsed_s = time.perf_counter() - start
        logger.info("%s", result.summary())
        return result

    def _visit_new(self, key: int, keep: bool = True) -> tuple[bytes, bool]:
        """Check a state reached for the first time and drain it. With `keep`, returns its snapshot and whether
        the world is still in that state (the drain found it already known); without, the state is not needed
        again (it will not be expanded) and no snapshot is taken."""
        world = self.world
        self._checked(world.check_state)
        snapshot = world.snapshot() if keep else b""
        self.result.num_drains += 1
        num_steps = self._checked(lambda: world.drain(self.drained_ok, key), in_drain=True)
        self.result.num_drain_steps += num_steps or 0
        self.best_remaining[key] = 0
        return snapshot, num_steps is None

    def _explore(self, key: int, snapshot: bytes, in_state: bool, remaining: int) -> None:
        """Expand the state `key` (saved in `snapshot`; `in_state`: the world is in it) with `remaining` actions
        left."""
        self.best_remaining[key] = remaining
        if remaining == 0:
            return
        if (
            self.config.max_states is not None
            and len(self.best_remaining) >= self.config.max_states
        ):
            self.result.complete = False
            return
        world = self.world
        if not in_state:
            world.restore(snapshot)
        actions = world.enabled_actions()
        children: list[int] = []
        index = -1
        while index + 1 < len(actions):
            index += 1
            action = actions[index]
            if index:
                world.restore(snapshot)
            num_in_flight = len(world.core.batch_queue)
            self.trace.append(action)
            try:
                self._checked(lambda action=action: world.apply(action))
            except _NotApplicable:
                self.trace.pop()
                continue
            if action.outcome == 0 and world.num_outcomes > 1:
                # The batch it ran can end in several ways (accepted draft lengths): each is an action.
                actions[index + 1 : index + 1] = self._other_outcomes(action, world.num_outcomes)
            self.result.coverage[(action.kind, num_in_flight)] += 1
            self.result.num_transitions += 1
            child = world.key()
            children.append(child)
            seen = self.best_remaining.get(child)
            if seen is None and remaining == 1:
                self._visit_new(child, keep=False)  # a leaf: checked and drained, never expanded
            elif seen is None:
                self._explore(child, *self._visit_new(child), remaining - 1)
            elif seen < remaining - 1:
                self._explore(child, world.snapshot(), True, remaining - 1)
            self.trace.pop()
        self.children.setdefault(key, children)

    def _other_outcomes(self, action: Action, num_outcomes: int) -> list[Action]:
        if num_outcomes > self.config.max_worker_outcomes:
            raise ValueError(
                f"a batch has {num_outcomes} outcomes, over max_worker_outcomes="
                f"{self.config.max_worker_outcomes}, after {' '.join(map(str, self.trace))}"
            )
        self.result.max_outcomes = max(self.result.max_outcomes, num_outcomes)
        return [Action(action.kind, action.arg, outcome) for outcome in range(1, num_outcomes)]

    def _checked(self, run: Callable[[], Any], in_drain: bool = False) -> Any:
        """`run()`, with any failure (an invariant, or an error raised by the engine) turned into an
        `InterleavingViolation` carrying the trace."""
        try:
            return run()
        except (_NotApplicable, InterleavingViolation):
            raise
        except Exception as error:
            message = f"{type(error).__name__}: {error}"
            raise InterleavingViolation(message, self.trace, in_drain) from error

    def _count_interleavings(self, root: int, depth: int) -> int:
        """Action sequences of length 0..depth from the root, counted over the explored graph."""
        memo: dict[tuple[int, int], int] = {}

        def count(key: int, remaining: int) -> int:
            if remaining == 0:
                return 1
            cached = memo.get((key, remaining))
            if cached is None:
                cached = 1 + sum(
                    count(child, remaining - 1) for child in self.children.get(key, ())
                )
                memo[(key, remaining)] = cached
            return cached

        return count(root, depth)


def explore(config: CheckerConfig) -> SearchResult:
    """Enumerate every interleaving of `config` up to `config.depth` actions and check each state (see the module
    docstring). Raises `InterleavingViolation` (with the action trace) on the first violation."""
    return _Search(config).run()


def find_violation(config: CheckerConfig) -> InterleavingViolation | None:
    """The first violation the search meets, or None when every interleaving passes."""
    try:
        explore(config)
    except InterleavingViolation as violation:
        return violation
    return None
