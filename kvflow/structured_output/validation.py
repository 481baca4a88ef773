"""The check the API server (and `LLM`) runs on a constraint before a request is queued: does it parse for the
backend that will compile it? Compiling against the vocabulary happens later, in the engine core."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvflow.structured_output import STRUCTURED_OUTPUT_BACKENDS

if TYPE_CHECKING:
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


def validate_structured_outputs(params: StructuredOutputsParams, backend: str) -> None:
    """ValueError naming the field (`structured_outputs.json`, `.regex`, `.grammar`, ...) when `params`' constraint
    is not valid for `backend` ("auto": valid for xgrammar or guidance; the first backend's error otherwise)."""
    params.validate()
    key = (backend, params.cache_key())
    if key in _VALID:
        _VALID.move_to_end(key)
        return
    _validate(params, backend)
    _VALID[key] = None
    if len(_VALID) > _VALID_CACHE_SIZE:
        _VALID.popitem(last=False)


def _validate(params: StructuredOutputsParams, backend: str) -> None:
    first_backend_that_takes(
        backends_to_try(backend), lambda name: STRUCTURED_OUTPUT_BACKENDS.get(name).validate(params)
    )
