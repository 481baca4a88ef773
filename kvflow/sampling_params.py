"""Sampling parameters: what a user may ask of one request's generation."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from typing import Any, Literal

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
# OpenAI's logit_bias range.
LOGIT_BIAS_LIMIT = 100.0
# The constraint fields of StructuredOutputsParams; a request sets exactly one.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One decoding constraint (vLLM's names): the output must match it, token by token.

    Exactly one of the constraint fields is set (`STRUCTURED_OUTPUT_KINDS`), else ValueError naming the fields:
      * `json`: a JSON schema (a dict or its JSON text); the output is a JSON value valid under it;
      * `regex`: the whole output matches the regular expression;
      * `choice`: the output is exactly one of these strings;
      * `grammar`: an EBNF grammar (GBNF / xgrammar's EBNF, or a Lark grammar for the guidance backend);
      * `json_object=True`: any JSON object;
      * `structural_tag`: xgrammar's structural tag (a JSON text).
    `disable_any_whitespace` forbids whitespace between JSON tokens (compact JSON); `disable_additional_properties`
    adds `"additionalProperties": false` to every object of a `json` schema that does not say otherwise.
    Which backend compiles it is the engine's `structured_outputs_config`. The constraint covers the whole output:
    EOS is allowed only where the constraint is complete, and a request whose constraint is complete stops.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    def validate(self) -> None:
        """Exactly one constraint, each of its type (ValueError naming the field). Whether a schema, regex or
        grammar compiles is the backend's check (`kvflow.structured_output.validate_structured_outputs`)."""
        kinds = self.constraint_kinds()
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "StructuredOutputsParams needs exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {found}"
            )
        checks = (
            (
                "json",
                self.json is None or isinstance(self.json, str | dict),
                "a dict or a JSON string",
            ),
            ("regex", self.regex is None or isinstance(self.regex, str), "a string"),
            (
                "choice",
                self.choice is None
                or (
                    isinstance(self.choice, list)
                    and bool(self.choice)
                    and all(isinstance(c, str) and c for c in self.choice)
                ),
                "a non-empty list of non-empty strings",
            ),
            ("grammar", self.grammar is None or isinstance(self.grammar, str), "a string"),
            ("json_object", self.json_object in (None, True, False), "a bool"),
            (
                "structural_tag",
                self.structural_tag is None or isinstance(self.structural_tag, str),
                "a JSON string",
            ),
            ("disable_any_whitespace", isinstance(self.disable_any_whitespace, bool), "a bool"),
            (
                "disable_additional_properties",
                isinstance(self.disable_additional_properties, bool),
                "a bool",
            ),
        )
        for field_name, ok, rule in checks:
            if not ok:
                raise ValueError(
                    f"StructuredOutputsParams.{field_name} must be {rule}, "
                    f"got {short_repr(getattr(self, field_name))}"
                )

    def constraint_kinds(self) -> list[str]:
        """The constraint fields that are set (`json_object=False` counts as unset)."""
        return [
            kind
            for kind in STRUCTURED_OUTPUT_KINDS
            if getattr(self, kind) is not None and getattr(self, kind) is not False
        ]

    @property
    def kind(self) -> str:
        """The one constraint field that is set."""
        return self.constraint_kinds()[0]

    def cache_key(self) -> tuple[Any, ...]:
        """A hashable identity of the constraint (compiled grammars are cached by it and the backend)."""
        import json as json_module

        values = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, dict | list):
                value = json_module.dumps(value, sort_keys=True)
            values.append(value)
        return tuple(values)


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    Invariants: every numeric field is within its documented range and fits the type the engine stores it in
    (integers in int64, `top_k` in int32, real values finite in float32), so no value that passes here can overflow
    inside an engine step; `stop` is a list of non-empty strings and `stop_token_ids` a list of non-negative ints.
    Invalid values raise `ValueError` naming the field. `temperature == 0` means greedy decoding; a `top_k` at or
    above the vocabulary size means the whole vocabulary (as 0 or -1 do).

    Logits controls (vLLM's semantics), applied before penalties and temperature:
      * `allowed_token_ids`: only these ids may be sampled;
      * `bad_words`: no listed word's token sequence is completed (both the word and its leading-space variant;
        the engine's input processor tokenizes them into `bad_words_token_ids`, which a caller never sets);
      * `logit_bias`: `{token_id: bias}` with bias in [-100, 100], added to the logits;
      * `truncate_prompt_tokens`: keep only the last k prompt tokens (-1: as many as leave room for one output
        token, `max_model_len - 1`).
    Ids must be inside the model's vocabulary (the engine checks; ValueError naming the field).
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar
    (`StructuredOutputsParams`); the sampled row's logits are masked to what the constraint allows.

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
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    # Set by the engine's input processor from `bad_words`: each word's token sequences.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.stop is None or isinstance(self.stop, list | tuple)):
            _fail("stop", "a string or a list of strings", self.stop)
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple)):
            _fail("stop_token_ids", "a list of ints", self.stop_token_ids)
        self.stop = list(self.stop) if self.stop else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
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
            (
                "allowed_token_ids",
                self.allowed_token_ids is None
                or (
                    isinstance(self.allowed_token_ids, list)
                    and bool(self.allowed_token_ids)
                    and all(_is_int(t, 0) for t in self.allowed_token_ids)
                ),
                "None or a non-empty list of ints in [0, 2**63)",
            ),
            (
                "bad_words",
                self.bad_words is None
                or (
                    isinstance(self.bad_words, list)
                    and all(isinstance(w, str) and w.strip() for w in self.bad_words)
                ),
                "None or a list of non-blank strings",
            ),
            (
                "logit_bias",
                self.logit_bias is None
                or (
                    isinstance(self.logit_bias, dict)
                    and all(
                        _is_int(t, 0) and _is_real(b, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
                        for t, b in self.logit_bias.items()
                    )
                ),
                "None or a dict of token ids (ints >= 0) to biases in [-100, 100]",
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens is None
                or self.truncate_prompt_tokens == -1
                or _is_int(self.truncate_prompt_tokens, 1),
                "None, -1 (max_model_len - 1) or an int >= 1",
            ),
            (
                "structured_outputs",
                self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "None or a StructuredOutputsParams",
            ),
        )
        for field_name, ok, rule in checks:
            if not ok:
                _fail(field_name, rule, getattr(self, field_name))
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


# The largest |length_penalty|: HF's and vLLM's users pass 0.0 - 2.0; past this the ranking's power over- or
# underflows a float for long sequences (1e30 raised OverflowError, -1e30 a ZeroDivisionError).
MAX_LENGTH_PENALTY = 10.0


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's `BeamSearchParams`), for `LLM.beam_search`.

    Invariants after construction: `beam_width >= 1`, `max_tokens >= 1`, `temperature` a finite float32 >= 0
    (each step's sampled token, drawn at this temperature, joins that beam's candidates; beams are ranked by the
    model's raw logprobs, as in vLLM), `length_penalty` a number in [-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY]
    (final ranking: cumulative logprob / sequence length ** length_penalty; the bound keeps that power a finite,
    non-zero float for any sequence up to 10**30 tokens). ValueError names the field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        checks = (
            ("beam_width", _is_int(self.beam_width, 1), "an int >= 1"),
            ("max_tokens", _is_int(self.max_tokens, 1), "an int >= 1"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a bool"),
            ("temperature", _is_real(self.temperature, 0.0), _NON_NEGATIVE_FLOAT32),
            (
                "length_penalty",
                _is_real(self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
                f"a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]",
            ),
            (
                "include_stop_str_in_output",
                isinstance(self.include_stop_str_in_output, bool),
                "a bool",
            ),
        )
        for field_name, ok, rule in checks:
            if not ok:
                raise ValueError(
                    f"BeamSearchParams.{field_name} must be {rule}, "
                    f"got {short_repr(getattr(self, field_name))}"
                )


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
