"""The model of a run: the requests the checker may add, the engine configuration and search bounds
(`CheckerConfig`), the enumerated events (`Action`), what a search reports, and the hash-model oracle."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kvflow.models.hash_model import DEFAULT_EOS_TOKEN_ID, reference_tokens
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

PauseVariant = tuple[str, bool]  # (mode, clear_cache)


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
    """One enumerated event: `kind` (see the package docstring), `arg` (a request id or a pause variant) and, for
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


class NotApplicable(Exception):
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
def oracle(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(reference_tokens(prompt, max_tokens))


def make_request(
    request_id: str, prompt: tuple[int, ...], max_tokens: int, resumable: bool
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        request_id, list(prompt), params, eos_token_id=DEFAULT_EOS_TOKEN_ID, resumable=resumable
    )
