"""The check the API server (and `LLM`) runs on a constraint before a request is queued: is it within the engine's
compile limits, and does it parse for the backend that will compile it? Compiling against the vocabulary happens
later, in the engine core."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvflow.structured_output import STRUCTURED_OUTPUT_BACKENDS

if TYPE_CHECKING:
    from kvflow.config import StructuredOutputsConfig
    from kvflow.sampling_params import StructuredOutputsParams

_T = TypeVar("_T")


def backends_to_try(backend: str) -> tuple[str, ...]:
    """The backends a `structured_outputs_config` backend compiles with, in order: "auto" is xgrammar, then
    guidance for what xgrammar cannot compile (vLLM's fallback)."""
    if backend == "auto":
        return ("xgrammar", "guidance")
    if backend not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(STRUCTURED_OUTPUT_BACKENDS.unknown_message(backend))
    return (backend,)


def first_backend_that_takes(backend_names: tuple[str, ...], attempt: Callable[[str], _T]) -> _T:
    """`attempt(name)` for each backend in turn until one does not raise ValueError. When none takes the constraint,
    one ValueError with every backend's reason (the first backend's first: it names the field)."""
    errors: list[tuple[str, ValueError]] = []
    for name in backend_names:
        try:
            return attempt(name)
        except ValueError as error:
            errors.append((name, error))
    (_, first), *others = errors
    if not others:
        raise first
    reasons = "; ".join(f"the {name} backend: {error}" for name, error in others)
    raise ValueError(f"{first} ({reasons})") from first


# Constraints already found valid, per backend (a repeated schema is parsed once per process); bounded.
_VALID: OrderedDict[tuple[str, tuple[object, ...]], None] = OrderedDict()
_VALID_CACHE_SIZE = 1024


def validate_structured_outputs(
    params: StructuredOutputsParams, config: StructuredOutputsConfig
) -> None:
    """ValueError naming the field (`structured_outputs.json`, `.regex`, `.grammar`, ...) when `params`' constraint
    exceeds `config`'s compile limits (`check_compile_limits`) or is not valid for its backend ("auto": valid for
    xgrammar or guidance; every backend's reason otherwise)."""
    params.validate()
    check_compile_limits(params, config)
    key = (config.backend, params.cache_key())
    if key in _VALID:
        _VALID.move_to_end(key)
        return
    _validate(params, config.backend)
    _VALID[key] = None
    if len(_VALID) > _VALID_CACHE_SIZE:
        _VALID.popitem(last=False)


def check_compile_limits(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
    """ValueError naming the field and the limit when the constraint has more choices, alternatives or characters
    than `config` allows (`StructuredOutputsConfig`: what drives compile cost, counted without compiling)."""
    kind = params.kind
    field = f"structured_outputs.{kind}"
    text = constraint_text(params)
    if kind == "choice":
        num_alternatives = len(params.choice or [])
        limit, what = config.max_choices, "max_choices"
        noun = "choices"
    else:
        num_alternatives = _count_alternatives(params)
        limit, what = config.max_alternatives, "max_alternatives"
        noun = "alternatives"
    if num_alternatives > limit:
        raise ValueError(
            f"{field} has {num_alternatives} {noun}, more than this server compiles "
            f"(structured_outputs_config {what}: {limit})"
        )
    if len(text) > config.max_constraint_chars:
        raise ValueError(
            f"{field} is {len(text)} characters long, more than this server compiles "
            f"(structured_outputs_config max_constraint_chars: {config.max_constraint_chars})"
        )


def constraint_text(params: StructuredOutputsParams) -> str:
    """The constraint as the text a backend parses: the regex, grammar or structural tag, the schema's JSON, or the
    choices one after another."""
    value = getattr(params, params.kind)
    if params.kind == "choice":
        return "".join(value or [])
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _count_alternatives(params: StructuredOutputsParams) -> int:
    """In a regex or grammar, one more than its `|` (an upper bound: a `|` in a class or a literal counts too); in a
    JSON schema, every enum value and anyOf / oneOf branch."""
    value = getattr(params, params.kind)
    if params.kind in ("regex", "grammar"):
        return str(value).count("|") + 1
    if params.kind != "json":
        return 0
    schema = value
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return 0  # the backend's parse names the error
    count = 0
    pending: list[object] = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key in ("enum", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    count += len(node[key])
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return count


def _validate(params: StructuredOutputsParams, backend: str) -> None:
    first_backend_that_takes(
        backends_to_try(backend), lambda name: STRUCTURED_OUTPUT_BACKENDS.get(name).validate(params)
    )
