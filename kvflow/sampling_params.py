"""Sampling parameters: what a user may ask of one request's generation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

OutputKind = Literal["cumulative", "delta", "final_only"]
_OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    Invariants: every numeric field is within its documented range, `stop` is a list of non-empty strings
    and `stop_token_ids` a list of non-negative ints. Invalid values raise `ValueError` naming the field.
    `temperature == 0` means greedy decoding.

    `logprobs` (per output token) and `prompt_logprobs` (per prompt token, vLLM's field) are None (off) or k >= 0:
    the logprob of the actual token plus the k most likely alternatives, from the model's raw distribution. A
    request with `prompt_logprobs` computes logits at every prompt position, so it never reads the prefix cache
    (it still fills it for later requests); see `RequestOutput.prompt_logprobs`. The engine caps both at its
    `max_logprobs`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: OutputKind = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            self.stop is None or isinstance(self.stop, list | tuple),
            "stop",
            f"must be a string or a list of strings, got {self.stop!r}",
        )
        _check(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple),
            "stop_token_ids",
            f"must be a list of ints, got {self.stop_token_ids!r}",
        )
        self.stop = list(self.stop) if self.stop else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an int >= 1, got {self.n!r}")
        _check(
            _is_real(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        _check(
            _is_real(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            f"must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}",
        )
        _check(
            _is_real(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        _check(
            self.seed is None or _is_int(self.seed),
            "seed",
            f"must be an int or None, got {self.seed!r}",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an int >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must hold non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must hold non-negative ints",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= 0),
                name,
                f"must be None or an int >= 0, got {value!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(
            _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty!r}",
        )
        _check(
            self.output_kind in _OUTPUT_KINDS,
            "output_kind",
            f"must be one of {_OUTPUT_KINDS}, got {self.output_kind!r}",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field_name} {message}")
