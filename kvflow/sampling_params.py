"""Sampling parameters: what a user may ask of one request's generation."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Literal

from kvflow.utils import short_repr

OutputKind = Literal["cumulative", "delta", "final_only"]
_OUTPUT_KINDS = ("cumulative", "delta", "final_only")

# Bounds of the types the fields become in the engine: int64 (msgspec, numpy, torch), int32 for top_k (a per-row
# tensor), float32 for the real-valued settings (per-row tensors of the sampler).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
_NON_NEGATIVE_FLOAT32 = f"a number in [0, {FLOAT32_MAX:.4g}]"
_POSITIVE_FLOAT32 = f"a number > 0 and at most {FLOAT32_MAX:.4g}"
_TOP_K_RULE = f"an int in [-1, {INT32_MAX}] (0 or -1: the whole vocabulary)"
_TOKEN_IDS_RULE = "a list of ints in [0, 2**63)"
_NUM_LOGPROBS_RULE = "None or an int in [0, 2**63)"


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    Invariants: every numeric field is within its documented range and fits the type the engine stores it in
    (integers in int64, `top_k` in int32, real values finite in float32), so no value that passes here can overflow
    inside an engine step; `stop` is a list of non-empty strings and `stop_token_ids` a list of non-negative ints.
    Invalid values raise `ValueError` naming the field. `temperature == 0` means greedy decoding; a `top_k` at or
    above the vocabulary size means the whole vocabulary (as 0 or -1 do).

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
        if not (self.stop is None or isinstance(self.stop, list | tuple)):
            _fail("stop", "a string or a list of strings", self.stop)
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple)):
            _fail("stop_token_ids", "a list of ints", self.stop_token_ids)
        self.stop = list(self.stop) if self.stop else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        self.validate()

    def validate(self) -> None:
        """Check every field (construction does; the engine core checks again what reaches it, since a dataclass
        can be changed after it was built). ValueError naming the first bad field. Messages are only formatted
        for a failure: this runs for every request."""
        if not isinstance(self.stop, list):
            _fail("stop", "a list of strings", self.stop)
        if not isinstance(self.stop_token_ids, list):
            _fail("stop_token_ids", "a list of ints", self.stop_token_ids)
        checks = (
            ("n", _is_int(self.n, 1), "an int >= 1"),
            ("temperature", _is_real(self.temperature, 0.0), _NON_NEGATIVE_FLOAT32),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", _is_int(self.top_k, -1, INT32_MAX), _TOP_K_RULE),
            ("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("seed", self.seed is None or _is_int(self.seed), "None or an int in [-2**63, 2**63)"),
            ("max_tokens", _is_int(self.max_tokens, 1), "an int in [1, 2**63)"),
            (
                "min_tokens",
                _is_int(self.min_tokens, 0, self.max_tokens if _is_int(self.max_tokens) else 0),
                "an int in [0, max_tokens]",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(_is_int(t, 0) for t in self.stop_token_ids), _TOKEN_IDS_RULE),
            ("logprobs", self.logprobs is None or _is_int(self.logprobs, 0), _NUM_LOGPROBS_RULE),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or _is_int(self.prompt_logprobs, 0),
                _NUM_LOGPROBS_RULE,
            ),
            ("presence_penalty", _is_real(self.presence_penalty, -2.0, 2.0), "in [-2, 2]"),
            ("frequency_penalty", _is_real(self.frequency_penalty, -2.0, 2.0), "in [-2, 2]"),
            (
                "repetition_penalty",
                _is_real(self.repetition_penalty, 0.0)
                and _float32_positive(self.repetition_penalty),
                _POSITIVE_FLOAT32,
            ),
            ("output_kind", self.output_kind in _OUTPUT_KINDS, f"one of {_OUTPUT_KINDS}"),
        )
        for field_name, ok, rule in checks:
            if not ok:
                _fail(field_name, rule, getattr(self, field_name))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> bool:
    """An int (not a bool) in [low, high]; the default range is int64's."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_real(value: object, low: float = -FLOAT32_MAX, high: float = FLOAT32_MAX) -> bool:
    """A finite int or float (not a bool) in [low, high]; the default range is float32's finite one."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and low <= value <= high
    except OverflowError:  # an int too large for a float
        return False


def _float32_positive(value: float) -> bool:
    """`value` stays > 0 once rounded to float32 (the smallest positive float32 is about 1.4e-45)."""
    return struct.unpack("f", struct.pack("f", value))[0] > 0


def wrap_int64(value: int) -> int:
    """`value` wrapped into int64's range (two's complement), e.g. a child's seed `seed + index`."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def _fail(field_name: str, rule: str, value: object) -> None:
    raise ValueError(f"SamplingParams.{field_name} must be {rule}, got {short_repr(value)}")
