"""What one `schedule()` call decided (`StepPlan`), and the per-request deltas the worker receives for the
requests it holds (`CachedRequestData`).

Invariant: per step, cost grows with the number of scheduled requests, not with their token histories: a full token
list is copied only for a request the persistent-batch runner may hold a stale copy of.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvflow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvflow.core.sched.output import CachedRequestData
from kvflow.core.sched.sessions import StreamingSessions
from kvflow.request import Request

# `CachedRequestData.new_token_ids` of a request with nothing new (steady decoding): shared, never modified.
_NO_TOKENS: list[int] = []


@dataclass
class StepPlan:
    """What one `schedule()` call decided, before it is turned into a `SchedulerOutput`.

    Invariants: `token_budget` is the step's budget minus the sum of `num_scheduled_tokens`; every scheduled
    request is in exactly one of `cached` (the worker holds it), `new` and `resumed`, and has an entry in
    `req_to_new_blocks`; a request in `preempted` is scheduled nowhere.
    """

    token_budget: int
    timestamp: float = 0.0  # time.monotonic() when the step was planned
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    cached: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Draft tokens scheduled for verification, per request (a prefix of its `spec_token_ids`).
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int, new_blocks: KVCacheBlocks) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.req_to_new_blocks[request.request_id] = new_blocks
        self.token_budget -= num_tokens

    def undo(self, request: Request) -> None:
        """Take back a running request scheduled earlier in this step (it is being preempted)."""
        self.cached.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.req_to_new_blocks.pop(request.request_id)
        self.spec_decode_tokens.pop(request.request_id, None)


def make_cached_request_data(
    running_reqs: list[Request],
    resumed_reqs: list[Request],
    req_to_new_blocks: dict[str, KVCacheBlocks],
    *,
    kv_cache_manager: KVCacheManager,
    sessions: StreamingSessions,
    send_all_tokens: bool,
    prev_step_scheduled_req_ids: set[str],
) -> CachedRequestData:
    """Per-request deltas for requests the worker holds; resumed ones only in the persistent-batch protocol.

    Cost is O(1) per request in steady decoding: new block ids and counters, no token history. A full
    token list goes out only to the persistent-batch runner, for requests it did not run in the previous
    step (its copy may be stale: `send_all_tokens`, with the ids it ran in `prev_step_scheduled_req_ids`); a
    streaming session's new chunk goes out once as `new_token_ids`.
    """
    scheduled = running_reqs + resumed_reqs if resumed_reqs else running_reqs
    data = CachedRequestData(
        req_ids=[request.request_id for request in scheduled],
        resumed_req_ids={request.request_id for request in resumed_reqs},
        num_computed_tokens=[request.num_computed_tokens for request in scheduled],
        num_output_tokens=[
            request.num_output_tokens + request.num_output_placeholders for request in scheduled
        ],
    )
    new_block_ids = data.new_block_ids
    # Most decode steps allocate nothing: that shared result is recognised by identity.
    no_new_blocks = kv_cache_manager.no_new_blocks
    for request in running_reqs:
        new_blocks = req_to_new_blocks.get(request.request_id)
        new_block_ids.append(
            None
            if new_blocks is no_new_blocks or new_blocks is None or new_blocks.is_empty
            else new_blocks.get_block_ids()
        )
    # A resumed request's block table is replaced whole.
    new_block_ids += [
        kv_cache_manager.get_block_ids(request.request_id) for request in resumed_reqs
    ]
    if send_all_tokens or sessions.has_unsent_chunks:
        data.new_token_ids = _unsent_token_ids(
            running_reqs,
            resumed_reqs,
            send_all_tokens,
            data.all_token_ids,
            sessions,
            prev_step_scheduled_req_ids,
        )
    else:
        # Steady decoding on the slot runner: the worker feeds its own sampled tokens. One shared empty
        # list (read-only, like every field the worker receives): a list per request only fed the collector.
        data.new_token_ids = [_NO_TOKENS] * len(scheduled)
    return data


def _unsent_token_ids(
    running_reqs: list[Request],
    resumed_reqs: list[Request],
    send_all_tokens: bool,
    all_token_ids: dict[str, list[int]],
    sessions: StreamingSessions,
    prev_step_scheduled_req_ids: set[str],
) -> list[list[int]]:
    """`CachedRequestData.new_token_ids` (a streaming session's unsent chunk, else empty), filling
    `all_token_ids` for the persistent-batch runner's requests whose copy may be stale."""
    # Steady decoding has no unsent chunk: then skip the per-request lookup (the set only shrinks here).
    any_unsent_chunk = sessions.has_unsent_chunks
    num_running = len(running_reqs)
    new_token_ids: list[list[int]] = []
    for position, request in enumerate(itertools.chain(running_reqs, resumed_reqs)):
        request_id = request.request_id
        chunk: list[int] = []
        # With placeholders the worker's copy is ahead of ours, not stale: sending ours would drop their tokens.
        worker_copy_may_be_stale = position >= num_running or (
            request_id not in prev_step_scheduled_req_ids and request.num_output_placeholders == 0
        )
        has_unsent_chunk = any_unsent_chunk and sessions.take_unsent_chunk(request_id)
        if send_all_tokens and worker_copy_may_be_stale:
            all_token_ids[request_id] = request.all_token_ids.copy()  # the chunk included
        elif has_unsent_chunk:
            # The chunk is exactly the tokens past the computed ones: applying it cut the computed count
            # back to the kept history. E.g., 12 kept tokens computed, chunk [x, y]: all_token_ids[12:].
            chunk = list(request.all_token_ids[request.num_computed_tokens :])
        new_token_ids.append(chunk)
    return new_token_ids
