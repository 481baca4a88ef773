"""Every message that crosses the scheduler <-> worker boundary.

The scheduler sends a `SchedulerOutput` per step; the worker answers with a `ModelRunnerOutput`. A step's message
carries what changed in that step only: a request's full token list travels when the worker cannot have it
(a new request, a slot-runner resume) or, for the persistent-batch protocol, when its copy may be stale.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvflow.spec_decode.metrics import (
    SpecDecodingStats,  # at runtime: msgspec encodes SchedulerStats by type
)

if TYPE_CHECKING:
    from kvflow.lora.request import LoRARequest
    from kvflow.pooling_params import PoolingParams
    from kvflow.request import Request
    from kvflow.sampling_params import SamplingParams


# A draft slot whose token the scheduler cannot know (async scheduling: the step that proposes it is in flight);
# the worker fills it with its own draft (`SchedulerOutput.scheduled_spec_decode_tokens`).
DRAFT_PLACEHOLDER = -1


@dataclass
class NewRequestData:
    """A request the worker has no state for: it takes a slot (slot runner) and gets everything it needs.

    `num_computed_tokens` is the count before this step (prefix-cache hits included). `prefill_token_ids` is set
    only for slot-runner resumes: the prompt plus the outputs so far, all of which must be recomputed.
    `lora_request` is the adapter the request runs with (None: the base model); it travels once, here, and the
    worker keeps it with the slot.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    prefill_token_ids: list[int] | None = None
    lora_request: LoRARequest | None = None
    # A pooling request (runner "pooling"): what to return once its prompt is computed; None: it generates.
    pooling_params: PoolingParams | None = None

    @classmethod
    def from_request(
        cls,
        request: Request,
        block_ids: tuple[list[int], ...],
        prefill_token_ids: list[int] | None = None,
    ) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            prefill_token_ids=prefill_token_ids,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )


@dataclass
class CachedRequestData:
    """Requests the worker already holds, as parallel lists indexed like `req_ids`.

    * `new_token_ids[i]`: tokens the worker has not seen (a streaming session's next chunk); empty in steady
      decoding, where the worker feeds its own sampled token.
    * `new_block_ids[i]`: blocks appended this step (or, for ids in `resumed_req_ids`, the replacement block
      table); None when nothing changed.
    * `all_token_ids`: persistent-batch protocol only, for requests not scheduled in the previous step.
    * `num_computed_tokens[i]`: the count before this step; `num_output_tokens[i]`: outputs so far (in-flight
      placeholders included).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


@dataclass
class SchedulerOutput:
    """One step's plan.

    The worker applies it in this order: release `finished_req_ids | preempted_req_ids`, add
    `scheduled_new_reqs`, update `scheduled_cached_reqs`; then runs `num_scheduled_tokens[req_id]` tokens per
    request (in that dict's order). `preempted_req_ids` reports every preemption since the previous output, each
    exactly once.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Drafts each request verifies this step: token ids, or `DRAFT_PLACEHOLDER`s for drafts the worker proposed
    # after a step still in flight (async scheduling), which it fills in itself.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_common_prefix_blocks: list[int] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # A scheduled request has a structured-output grammar: the worker runs the forward pass and waits for the
    # step's `GrammarOutput` (`sample_tokens`) before it samples.
    has_structured_output_requests: bool = False

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData.make_empty(), {}, 0)


@dataclass
class GrammarOutput:
    """The token bitmask of one step's structured-output requests, sent to the worker after the forward pass.

    Row i of `grammar_bitmask` (int32 `[len(structured_output_request_ids), ceil(vocab_size / 32)]`; bit `t % 32`
    of word `t // 32` set iff token `t` is allowed) belongs to `structured_output_request_ids[i]`. The worker masks
    exactly the sampled rows of these requests; every other row is untouched.
    """

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray


@dataclass
class LogprobsLists:
    """Token logprobs, one row per token: `[token, top-1, ..., top-k]` ids, their logprobs, and the token's rank.

    Sampled tokens (`ModelRunnerOutput.logprobs`, `EngineCoreOutput.new_logprobs`): one row per batch row or new
    token, the token being the sampled one. Prompt tokens (`ModelRunnerOutput.prompt_logprobs_dict`,
    `EngineCoreOutput.new_prompt_logprobs`): row j is the distribution of prompt token `start_index + j` given the
    tokens before it (so `start_index >= 1`: prompt token 0 has none), the token being that actual prompt token.
    `start_index` is unused (0) for sampled tokens. Ranks are 1-based; the top-k come in rank order.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]
    start_index: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.logprobs)


@dataclass
class ModelRunnerOutput:
    """What one step produced: `sampled_token_ids[req_id_to_index[req_id]]` (empty for a partial prefill; with
    speculative decoding the accepted drafts and the token after them: 1 to drafts + 1 tokens).

    `prompt_logprobs_dict` (None when no scheduled request asked for prompt logprobs) maps each request that
    computed prompt positions this step to their rows: prompt tokens `start_index .. start_index + num_rows - 1`,
    contiguous with the request's earlier chunks. A request recomputing its prompt after a preemption sends rows it
    sent before; the scheduler keeps the first copy.

    `failed_req_ids` (None when none) maps each request whose sampling failed on its own this step to the error's
    text; its sampled token is a placeholder, and the scheduler ends it with finish_reason "error".
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    prompt_logprobs_dict: dict[str, LogprobsLists] | None = None
    failed_req_ids: dict[str, str] | None = None
    # With speculative drafts, `logprobs` holds one row per emitted token and batch row i's rows start at
    # `logprobs_row_starts[i]` (None: row i of `logprobs` is batch row i's single token).
    logprobs_row_starts: list[int] | None = None
    # Speculative decoding: the drafts the runner proposes for each batch row's next step (indexed like
    # `sampled_token_ids`; None when the runner does not speculate).
    spec_token_ids: list[list[int]] | None = None
    # Speculative decoding: how many of each batch row's verified drafts were real proposals (the rest of its
    # scheduled draft slots were padding; None: all were real).
    num_real_drafts: list[int] | None = None
    # Pooling runner: each batch row's pooled result (float32), for the rows whose prompt completed this step;
    # None for the others (and None as a whole from a generating runner).
    pooler_output: list[np.ndarray | None] | None = None

    @classmethod
    def make_empty(cls) -> ModelRunnerOutput:
        return cls([], {}, [])


class EngineCoreEventType(enum.IntEnum):
    """A step in a request's life in the engine core."""

    QUEUED = 1  # added to the scheduler (a streaming session: each chunk)
    SCHEDULED = (
        2  # first scheduled since it was queued (resumes after a preemption are not reported)
    )
    PREEMPTED = 3  # preempted by recompute (it will be scheduled again)


@dataclass
class EngineCoreEvent:
    """One lifecycle event of a request, stamped by the engine core with `time.monotonic()`.

    The stamps compare with the front end's `time.monotonic()` even when the core runs in another process: on Linux
    the monotonic clock (CLOCK_MONOTONIC) is system-wide, so both processes read the same clock on one machine.
    """

    type: EngineCoreEventType
    timestamp: float


class PooledData(msgspec.Struct, gc=False):
    """A pooling request's result on its way to the front end: a float32 array as its shape and little-endian
    bytes (msgspec encodes bytes as one blob, not a list of floats)."""

    shape: list[int]
    data: bytes

    @classmethod
    def from_array(cls, array: np.ndarray) -> PooledData:
        values = np.ascontiguousarray(array, dtype="<f4")
        return cls(list(values.shape), values.tobytes())

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<f4").reshape(self.shape)


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, gc=False):
    """What the engine reports about one request after a step.

    `finish_reason` is "stop", "length" or "abort" when generation ended, or "error" when the request failed alone
    inside a step (then `stop_reason` holds the error's text, and `client_error` says whether the request itself
    is at fault: its constraint did not compile, or not in time; the API answers 400 for those, 500 otherwise).
    For a streaming-input session a chunk can end while the session stays open: then `session_continues` is True
    and the request is not finished.

    `new_prompt_logprobs` (requests with `SamplingParams.prompt_logprobs` and at least two prompt tokens) comes once,
    on the request's first output with tokens: the rows of prompt tokens 1 .. num_prompt_tokens - 1
    (`start_index` 1). `events` are the lifecycle events since the request's previous output, oldest first; events
    of a request that has produced no output yet ride on its next one. Both are None otherwise.

    A msgspec Struct rather than a dataclass: one is built per scheduled request per step, and a Struct builds
    several times faster. It encodes as a map without the fields left at their defaults; change a copy with
    `msgspec.structs.replace`.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    session_continues: bool = False
    # One row per new token, when the request asked for logprobs.
    new_logprobs: LogprobsLists | None = None
    # The model weights that computed `new_token_ids` (see EngineCore.update_weights).
    weight_version: int = 0
    new_prompt_logprobs: LogprobsLists | None = None
    events: list[EngineCoreEvent] | None = None
    client_error: bool = False
    # A finished pooling request's result (its only output; `new_token_ids` is empty).
    pooling_output: PooledData | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None and not self.session_continues


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for metrics and logs.

    `kv_cache_usage` is the fraction of KV blocks in use (0..1); the prefix-cache counts are prompt tokens looked
    up and found at admission since startup, counting each request's first admission only (the recompute after a
    preemption would hit the blocks it had just written, inflating the hit rate; a streaming session's later
    chunks keep their blocks and look nothing up), and never requests that skip the cache (prompt logprobs);
    `num_preemptions_total` counts preemptions since startup. The counts only grow, so a reader takes
    differences between snapshots (of the same engine core). `engine_index` names the core among the data-parallel
    cores of one front end (0 with one core); the front end sets it, a core does not know it.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions_total: int
    engine_index: int = 0
    # Speculative decoding's verification counts since startup (None without speculation).
    spec_decoding_stats: SpecDecodingStats | None = None
    # LoRA: adapter name -> running / waiting requests with it (empty with LoRA off).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
