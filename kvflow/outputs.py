"""What users get back: one `RequestOutput` per prompt from `LLM.generate`; one `PoolingRequestOutput` (or its
`Embedding` / `Classification` / `Scoring` form) per prompt from `LLM.encode` / `embed` / `classify` / `score`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvflow.lora.request import LoRARequest


@dataclass
class Logprob:
    """One candidate token's log probability under the model's raw distribution, with its 1-based rank there
    (1 = the most likely token) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence. `finish_reason` is "stop", "length", "abort" or None while still running.

    `stop_reason` is the stop string or stop token id that ended it (None for EOS or a length cap); with finish_reason
    "error", the error's text, and `client_error` is True when the request itself was at fault (a constraint that
    did not compile, or not within the engine's compile timeout). With
    `SamplingParams.logprobs`, `logprobs[i]` maps token ids to `Logprob`s at output position i: the sampled token
    and the top-`logprobs` alternatives; `cumulative_logprob` sums the sampled tokens' logprobs. `weight_versions`
    lists, in order, the weight versions (see `LLM.update_weights`) whose forward passes produced the tokens.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    weight_versions: list[int] = field(
        default_factory=list
    )  # distinct weight versions that made the tokens
    client_error: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timing, preemptions and prefix-cache hit size.

    The times are wall-clock seconds since the epoch, like `time.time()` and vLLM's `arrival_time`:
    `arrival_time` when the request arrived, `queued_time` when the engine core queued it (added it to the
    scheduler), `first_scheduled_time` when the core first scheduled it, `first_token_time` when its first output
    token reached the front end, `last_token_time` when its latest one did, `finished_time` when it finished; each
    is None until it happened (an aborted request may never be scheduled). Only `arrival_time` reads the wall
    clock; the others are `arrival_time` plus a `time.monotonic()` delta (the core's stamps included: the
    monotonic clock is system-wide on Linux), so differences between them (time to first token, queue time,
    `finished_time - arrival_time` end to end) are exact durations even if the system clock is adjusted
    meanwhile. `num_preemptions` counts preemptions by recompute; `num_cached_tokens` is the number of prompt
    tokens served from the prefix cache. A parallel-sampling request (n > 1) reports its earliest queued and
    scheduled times, its latest token and the sum of its samples' preemptions.
    """

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0


PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestOutput:
    """The state of one request: its prompt, the outputs so far, and whether it finished.

    `prompt_logprobs` (with `SamplingParams.prompt_logprobs`, else None) has one entry per prompt token: entry 0 is
    None (nothing precedes the first token), entry i maps token ids to `Logprob`s of the distribution at position i
    given the tokens before it: the actual prompt token i first (with its rank), then the top `prompt_logprobs`
    tokens in rank order (a token among both appears once, first). They are computed while the prompt is prefilled
    and come complete, with the first output token: every later output carries them too, except with
    `output_kind="delta"`, where only the first output that has them does (earlier ones have None, as has a request
    aborted before its first token). With n > 1 they are computed once and shared by the samples.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # The LoRA adapter it ran with (None: the base model), as vLLM's RequestOutput reports it.
    lora_request: LoRARequest | None = None


@dataclass
class PoolingOutput:
    """A pooling request's result: `data`, a float32 tensor (an embedding or class probabilities `[d]`, a score
    `[1]`, or with pooling type "ALL" one row per prompt token `[num_tokens, hidden]`)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The finished output of one pooling request (`LLM.encode`, `AsyncLLM.encode`): its prompt's token ids and
    the pooled result. `finished` is always True (a pooling request reports once); `num_cached_tokens` counts
    prompt tokens read from the prefix cache (decoder models only)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    """One embedding (`LLM.embed`): its values, L2-normalized unless the request or pooler config said not to."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """One classification (`LLM.classify`): a probability per label (softmax; sigmoid for a one-label model), or
    the raw logits with `use_activation=False`."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """One relevance score (`LLM.score`): a cross-encoder's probability that the pair is relevant, or the cosine
    similarity of two embeddings."""

    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
