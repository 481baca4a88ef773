"""What a user may ask of one pooling request (vLLM's `PoolingParams`), and the pooler's engine-wide settings
(vLLM's `PoolerConfig`).

A pooling request runs its prompt once, generates nothing, and returns one pooled result: an embedding (`embed`),
class probabilities (`classify`), a relevance score of a text pair (`score`, cross-encoders) or the raw pooled
hidden states (`encode`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

PoolingTask = Literal["embed", "classify", "score", "encode"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "encode")
PoolingType = Literal["LAST", "MEAN", "CLS", "ALL"]
POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS", "ALL")
RUNNER_TYPES: tuple[str, ...] = ("auto", "generate", "pooling")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_optional_bool(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool or None, got {value!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """How the engine pools a sequence's last hidden states (vLLM's names).

    `pooling_type`: "LAST" (the final token's state; decoder embedders), "MEAN" (the mean over every token), "CLS"
    (the first token's), "ALL" (every token's, `encode` only). `normalize`: embeddings are L2-normalized (the
    default; sentence-transformers' `Normalize` module says so, and a checkpoint without one still gets vLLM's
    default True). `dimensions`: every embedding is cut to its first `dimensions` values (then normalized), the
    engine-wide default of the request's own `dimensions`. `use_activation`: classifier outputs go through softmax
    (sigmoid for a one-label model). None means "the model's default" (see `kvflow.pooling.config`).
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        _check_optional_bool("pooler_config normalize", self.normalize)
        _check_optional_bool("pooler_config use_activation", self.use_activation)
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(
                f"pooler_config dimensions must be an int >= 1, got {self.dimensions!r}"
            )

    @classmethod
    def from_option(cls, option: PoolerConfig | dict[str, Any] | None) -> PoolerConfig:
        """A `PoolerConfig` from the engine option: itself, a dict of its fields (an unknown key is a ValueError
        naming it), or None (every field the model's default)."""
        if option is None:
            return cls()
        if isinstance(option, cls):
            return option
        if not isinstance(option, dict):
            raise ValueError(
                f"pooler_config must be a dict or PoolerConfig, got {type(option).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(option) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**option)


@dataclass
class PoolingParams:
    """One pooling request's settings (vLLM's names).

    * `task`: what to return; set by `LLM.embed` / `classify` / `score` / `encode` and by the server's endpoint
      (None: the model's first task, `embed` for embedding models and `classify` for classifiers).
    * `dimensions` (embed): keep the first `dimensions` values (Matryoshka); must be at most the hidden size and,
      where the model declares the sizes it was trained for, one of them.
    * `normalize` (embed, encode): L2-normalize; None follows the pooler config.
    * `use_activation` (classify, score): softmax over the labels (sigmoid with one label); None follows the
      pooler config (on by default). False returns the raw logits.
    * `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: as many as `max_model_len` holds); a prompt
      longer than `max_model_len` without it is refused.

    `token_type_start` is set by kvflow, not users: the first position of the second text of a cross-encoder pair
    (token type 1 from there on; vLLM's compressed token type ids). None: every token has type 0.
    """

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first field that holds a value no request may have."""
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an int >= 1, got {self.dimensions!r}")
        _check_optional_bool("normalize", self.normalize)
        _check_optional_bool("use_activation", self.use_activation)
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not _is_int(truncate) or truncate < -1 or truncate == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an int >= 1, got {truncate!r}")
        start = self.token_type_start
        if start is not None and (not _is_int(start) or start < 0):
            raise ValueError(f"token_type_start must be an int >= 0, got {start!r}")
        if self.dimensions is not None and self.task not in (None, "embed"):
            raise ValueError(f"dimensions applies to task 'embed', not {self.task!r}")
