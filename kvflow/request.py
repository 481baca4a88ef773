"""The scheduler's view of one request: its tokens, progress and lifecycle status."""

from __future__ import annotations

import enum
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreEvent, LogprobsLists
    from kvflow.lora.request import LoRARequest
    from kvflow.pooling_params import PoolingParams
    from kvflow.sampling_params import SamplingParams
    from kvflow.structured_output.request import StructuredOutputRequest

BlockHasher = Callable[["Request"], list[Any]]


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is a finished one.

    An IntEnum so statuses order (`is_finished` compares with PREEMPTED), but it prints and formats as its name:
    `f"{RequestStatus.WAITING}" == "WAITING"`, not the number.
    """

    WAITING = enum.auto()
    # Waiting for its structured-output grammar to compile; the scheduler passes over it meanwhile.
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __str__(self) -> str:
        return self.name

    def __format__(self, format_spec: str) -> str:
        # IntEnum members format as int; define both, since f-strings call __format__, not __str__.
        return format(self.name, format_spec)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > _LAST_UNFINISHED_STATUS

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """The OpenAI-style finish reason of a finished status ("stop", "length", "abort"; "error" for a request
        that failed alone inside a step, as vLLM reports it)."""
        return _FINISH_REASONS.get(status)


# A module constant: looking a member up on the enum class costs more than the comparison (hot path).
_LAST_UNFINISHED_STATUS = RequestStatus.PREEMPTED

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class ConstantList(Sequence):
    """A read-only view of a list: indexing, slicing, len and iteration, but no mutation."""

    __slots__ = ("_items",)

    def __init__(self, items: list[int]) -> None:
        self._items = items

    def __getitem__(self, index):  # type: ignore[override]
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._items == other._items
        return self._items == other

    def __hash__(self) -> int:  # lists are unhashable; so is a view of one
        raise TypeError("unhashable type: 'ConstantList'")

    def copy(self) -> list[int]:
        return self._items.copy()

    def __repr__(self) -> str:
        return f"ConstantList({self._items!r})"


@dataclass
class StreamingUpdate:
    """One more chunk of prompt for a streaming-input session (None in a queue means: session ends)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float

    @classmethod
    def from_request(cls, request: Request) -> StreamingUpdate | None:
        """The update a same-id request carries; None when it closes the session (not resumable, no tokens)."""
        if not request.resumable and not request.prompt_token_ids:
            return None
        return cls(list(request.prompt_token_ids), request.sampling_params, request.arrival_time)


class Request:
    """A request as the scheduler tracks it.

    Invariants:
      * `all_token_ids == prompt_token_ids + output_token_ids`; both views are read-only, tokens are added only
        through `append_output_token_ids` (which also extends `block_hashes` for every newly full block).
      * `num_computed_tokens <= num_tokens + num_output_placeholders`: tokens whose KV is (or is being) written.
      * `num_output_placeholders` counts placeholders: tokens sampled by a step in flight (async scheduling), not
        yet appended, counting a step that verifies d drafts as d + 1 (the most it can yield); `num_in_flight_steps`
        counts those steps. `async_tokens_to_discard` counts stale step outputs (in flight when the request was
        preempted or stopped), each dropped whole on arrival (one token each without speculation).
      * `block_hashes[i]` is the chained hash of the i-th full block of `all_token_ids`.
      * prompt logprobs: `prompt_logprobs_rows` holds the rows received for prompt tokens 1..k (contiguous, None
        before the first) until the first output token carries them out; once the request has outputs no row is
        taken any more. Until then (`skip_reading_prefix_cache`) the request computes its whole prompt: a
        prefix-cache hit would skip positions whose logprobs are still missing.
      * `events` are the lifecycle events not yet reported; `scheduled_since_queued` says whether the request was
        scheduled since its latest QUEUED event (so SCHEDULED is recorded once per queueing).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        resumable: bool = False,
        block_hasher: BlockHasher | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = priority
        self.resumable = resumable
        self.cache_salt = cache_salt
        # The adapter it runs with (None: the base model); its id keys the request's prefix-cache blocks.
        self.lora_request = lora_request
        # A pooling request (runner "pooling"): it computes its prompt, returns one pooled result and finishes,
        # generating nothing (None: it generates).
        self.pooling_params = pooling_params

        self.status = RequestStatus.WAITING
        # Set by the engine core for a request with `sampling_params.structured_outputs`; it then waits in
        # WAITING_FOR_FSM until its grammar has compiled (see `StructuredOutputManager`).
        self.structured_output_request: StructuredOutputRequest | None = None
        self.stop_reason: int | str | None = None
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids = ConstantList(self._output_token_ids)
        self.all_token_ids = ConstantList(self._all_token_ids)

        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 until admitted
        self.spec_token_ids: list[int] = []
        # How many drafts the worker proposed after the request's latest applied step (async scheduling plans
        # that many draft slots for a step whose drafts are still unknown).
        self.num_last_proposed_drafts = 0
        self.num_output_placeholders = 0
        self.num_in_flight_steps = 0
        self.async_tokens_to_discard = 0
        self.num_preemptions = 0
        self.prompt_logprobs_rows: LogprobsLists | None = None
        self.events: list[EngineCoreEvent] = []
        self.scheduled_since_queued = False
        self.streaming_queue: deque[StreamingUpdate | None] | None = deque() if resumable else None

        self.block_hashes: list[Any] = []
        self._block_hasher: BlockHasher | None = None
        # The hasher's block size when it tells one (0: ask the hasher after every append), and the token count
        # at which the next block fills, so appends before it skip the hasher (never, without a hasher).
        self._hash_block_size = 0
        self._num_tokens_to_next_hash = sys.maxsize
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    # ----------------------------------------------------------------------------------------------- tokens
    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.append_output_token_id(token_ids)
            return
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if len(self._all_token_ids) >= self._num_tokens_to_next_hash:
            self.update_block_hashes()

    def append_output_token_id(self, token_id: int) -> None:
        """`append_output_token_ids` for one token (the scheduler's per-step path: no type check)."""
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if len(self._all_token_ids) >= self._num_tokens_to_next_hash:
            self.update_block_hashes()

    def set_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Attach the hasher (the scheduler does this on add) and hash every full block so far."""
        self._block_hasher = block_hasher
        self._hash_block_size = getattr(block_hasher, "block_size", None) or 0
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is None:
            return
        self.block_hashes.extend(self._block_hasher(self))
        block_size = self._hash_block_size
        self._num_tokens_to_next_hash = (
            (len(self.block_hashes) + 1) * block_size if block_size else 0
        )

    def extend_prompt(self, token_ids: list[int]) -> None:
        """Streaming sessions: fold outputs into the prompt, drop the last sampled token, append a new chunk.

        The last sampled token was never fed back to the model (its KV does not exist), so it is dropped; every
        earlier output becomes prompt. Block hashes of full blocks that survive the cut stay valid.
        """
        # E.g., prompt [p0..p9], outputs [a, b, c], chunk [x, y]: the prompt becomes [p0..p9, a, b, x, y].
        num_kept = self.num_tokens - 1 if self._output_token_ids else self.num_tokens
        del self._all_token_ids[num_kept:]
        self._output_token_ids.clear()
        self.prompt_token_ids[:] = self._all_token_ids
        self.prompt_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # A block that held the dropped token is stale: keep only hashes of blocks that are still full.
        # E.g., block_size 4, 13 tokens (3 hashed blocks), 12 kept: the dropped token (index 12) sat in block 3,
        # so all 12 // 4 = 3 hashes stay; with 12 tokens and 11 kept, block 2 lost index 11: 11 // 4 = 2 stay.
        block_size = self._hash_block_size
        del self.block_hashes[num_kept // block_size if block_size else 0 :]
        self.update_block_hashes()

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True while the request still needs prompt logprobs, which take logits at every prompt position (its
        first output token comes with all of them)."""
        return self.sampling_params.prompt_logprobs is not None and not self._output_token_ids

    # ----------------------------------------------------------------------------------------------- status
    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED_STATUS

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
