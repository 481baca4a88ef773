"""No silent fields: the request fields kvflow declares but does not implement yet, and those that do not apply to
beam search, refused in one place.

A field of OpenAI's or vLLM's schema that kvflow ignored would change what the client gets without a sign (code
ported from vLLM would get plain sampling where it asked for its logits processors). So each such field is
declared in `protocol.py` and listed here with its "off" value: sent off (absent, null, `false`, `[]`, ...) it is
fine; sent with any other value it is a 400 naming it, saying it is not supported yet and, where there is one,
what to use instead. Beam search (`use_beam_search: true`, `serving_beam_search.py`) ranks beams by the model's
raw logprobs and ends them at EOS or `max_tokens` only, so the sampling fields that would change that
(`BEAM_SEARCH_FIELDS`) must be off with it; `length_penalty` ranks beams, so without beam search it must be off
(1.0). A field in neither schema is unknown: `UnknownFields` logs its name once per server process and the
request goes on without it, as in vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.entrypoints.openai.errors import OpenAIServingError

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.protocol import SamplingFields

logger = logging.getLogger(__name__)

_WHITESPACE = (
    "kvflow's JSON constraints take any whitespace between tokens, or none with "
    "structured_outputs: {'disable_any_whitespace': true}; a whitespace pattern is not taken"
)
_FUNCTIONS = (
    "OpenAI's deprecated functions API is not served; send the functions as tools ({'type': 'function', "
    "'function': {...}}) with tool_choice"
)


@dataclass(frozen=True)
class UnsupportedField:
    """A declared field that is refused unless `is_off(value, request)`; `why` ends the error message."""

    name: str
    is_off: Callable[[Any, Any], bool]
    why: str


def _is_none(value: Any, _: Any) -> bool:
    return value is None


def _is_empty(value: Any, _: Any) -> bool:
    return not value


def _is_false(value: Any, _: Any) -> bool:
    return value is False


def _is_no_function_call(value: Any, _: Any) -> bool:
    return value in (None, "none")


UNSUPPORTED_FIELDS: tuple[UnsupportedField, ...] = (
    UnsupportedField("guided_whitespace_pattern", _is_none, _WHITESPACE),
    UnsupportedField("functions", _is_empty, _FUNCTIONS),
    UnsupportedField("function_call", _is_no_function_call, _FUNCTIONS),
    UnsupportedField(
        "logits_processors", _is_empty, "kvflow does not run logits processors; drop the field"
    ),
    UnsupportedField(
        "prompt_embeds",
        _is_none,
        "kvflow takes prompts as text or token ids only",
    ),
)


_BEAM_RANKING = (
    "beam search ranks beams by the model's raw logprobs, so this field would have no effect"
)
_BEAM_ENDS = "beam search ends a beam at EOS or max_tokens only"
_BEAM_CONSTRAINT = "beam search does not constrain its beams"


def _is_none_or(*neutral: object) -> Callable[[Any, Any], bool]:
    """Off when absent or one of the `neutral` values (which change nothing)."""
    return lambda value, _: value is None or value in neutral


def _is_text_format(value: Any, _: Any) -> bool:
    return value is None or value.type == "text"


# Fields that must be off with `use_beam_search: true` (each is a 400 naming it otherwise).
BEAM_SEARCH_FIELDS: tuple[UnsupportedField, ...] = (
    UnsupportedField(
        "stream",
        _is_false,
        "beam search ranks its beams only when it ends, so there is nothing to stream; send stream: false",
    ),
    UnsupportedField("top_p", _is_none_or(1.0), _BEAM_RANKING),
    UnsupportedField("top_k", _is_none_or(0, -1), _BEAM_RANKING),
    UnsupportedField("min_p", _is_none_or(0.0), _BEAM_RANKING),
    UnsupportedField("presence_penalty", _is_none_or(0.0), _BEAM_RANKING),
    UnsupportedField("frequency_penalty", _is_none_or(0.0), _BEAM_RANKING),
    UnsupportedField("repetition_penalty", _is_none_or(1.0), _BEAM_RANKING),
    UnsupportedField("logit_bias", _is_empty, _BEAM_RANKING),
    UnsupportedField("allowed_token_ids", _is_none, _BEAM_RANKING),
    UnsupportedField("bad_words", _is_empty, _BEAM_RANKING),
    UnsupportedField(
        "seed",
        _is_none,
        "beam search is deterministic at temperature 0, and its steps' samples at a higher temperature are not "
        "seeded",
    ),
    UnsupportedField("stop", _is_empty, _BEAM_ENDS),
    UnsupportedField("stop_token_ids", _is_empty, _BEAM_ENDS),
    UnsupportedField("min_tokens", lambda value, _: value == 0, _BEAM_ENDS),
    UnsupportedField(
        "prompt_logprobs", _is_none, "beam search does not compute the prompt's logprobs"
    ),
    UnsupportedField("response_format", _is_text_format, _BEAM_CONSTRAINT),
    UnsupportedField("structured_outputs", _is_none, _BEAM_CONSTRAINT),
    UnsupportedField("guided_json", _is_none, _BEAM_CONSTRAINT),
    UnsupportedField("guided_regex", _is_none, _BEAM_CONSTRAINT),
    UnsupportedField("guided_choice", _is_none, _BEAM_CONSTRAINT),
    UnsupportedField("guided_grammar", _is_none, _BEAM_CONSTRAINT),
    UnsupportedField("structural_tag", _is_none, _BEAM_CONSTRAINT),
)


def refuse_unsupported_fields(request: SamplingFields) -> None:
    """400 naming the first field of `request` that kvflow declares but does not implement yet, sent with a value
    other than its off one (the table above, in its order); with `use_beam_search`, then the first field of
    `BEAM_SEARCH_FIELDS` that is not off; without it, a `length_penalty` other than 1.0."""
    _refuse(request, UNSUPPORTED_FIELDS, "is not supported by kvflow yet")
    if request.use_beam_search:
        _refuse(request, BEAM_SEARCH_FIELDS, "does not apply to beam search (use_beam_search)")
    elif request.length_penalty != 1.0:
        raise OpenAIServingError(
            "length_penalty applies only with use_beam_search: true (it ranks the beams); drop it, or ask for "
            "beam search",
            param="length_penalty",
        )


def _refuse(request: SamplingFields, fields: tuple[UnsupportedField, ...], what: str) -> None:
    declared = type(request).model_fields
    for field in fields:
        if field.name not in declared:
            continue
        value = getattr(request, field.name)
        if not field.is_off(value, request):
            raise OpenAIServingError(f"{field.name} {what}: {field.why}", param=field.name)


class UnknownFields:
    """Logs the names of request fields in neither OpenAI's nor vLLM's schema, each once per server process (one
    instance per app), and nothing else: such fields are ignored, as in vLLM.

    Invariant: remembers at most `max_names` names, so a client sending ever new names cannot grow the server or
    flood its log; past that, one warning says further names are not logged.
    """

    def __init__(self, max_names: int = 1024) -> None:
        self.max_names = max_names
        self._logged: set[str] = set()
        self._full = False

    def report(self, names: set[str] | dict[str, Any] | None) -> None:
        """Log each of `names` not logged before."""
        new = sorted(set(names or ()) - self._logged)
        if not new or self._full:
            return
        room = self.max_names - len(self._logged)
        logged, dropped = new[:room], new[room:]
        self._logged.update(logged)
        if logged:
            logger.warning(
                "Request fields ignored (not in OpenAI's or vLLM's schema; logged once each): %s",
                logged,
            )
        if dropped or len(self._logged) >= self.max_names:
            self._full = True
            logger.warning(
                "%d names of ignored request fields logged: further ones are not", self.max_names
            )
