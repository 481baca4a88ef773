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

Modules
    model         the requests, `CheckerConfig`, `Action`, `SearchResult`, the oracle
    worker        `PagedHashWorker` (the worker model) and the future of a batch it ran
    expectations  what the checker expects of each request, checked as outputs arrive
    world         the engine core with the worker model, driven one `Action` at a time, and the drain
    checks        the transition checks, the state checks and the drain's clean end
    keys          canonical keys of a `SchedulerOutput`, a request and a scheduler (deduplication)
    search        the explorer: `explore`, `find_violation`
"""

from kvflow.testing.interleavings.model import (
    ALL_PAUSE_VARIANTS,
    DEFAULT_PAUSE_VARIANTS,
    DEFAULT_REQUESTS,
    SPEC_REQUESTS,
    Action,
    CheckerConfig,
    InterleavingViolation,
    PauseVariant,
    RequestSpec,
    SearchResult,
)
from kvflow.testing.interleavings.search import explore, find_violation
from kvflow.testing.interleavings.worker import REJECTED_DRAFT, PagedHashWorker

__all__ = [
    "ALL_PAUSE_VARIANTS",
    "DEFAULT_PAUSE_VARIANTS",
    "DEFAULT_REQUESTS",
    "REJECTED_DRAFT",
    "SPEC_REQUESTS",
    "Action",
    "CheckerConfig",
    "InterleavingViolation",
    "PagedHashWorker",
    "PauseVariant",
    "RequestSpec",
    "SearchResult",
    "explore",
    "find_violation",
]
