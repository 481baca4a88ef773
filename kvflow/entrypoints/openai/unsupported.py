"""No silent fields: the request fields kvflow declares but does not implement yet, refused in one place.

A field of OpenAI's or vLLM's schema that kvflow ignored would change what the client gets without a sign (code
ported from vLLM would get plain sampling where it asked for beam search). So each such field is declared in
`protocol.py` and listed here with its "off" value: sent off (absent, null, `false`, `[]`, ...) it is fine; sent
with any other value it is a 400 naming it, saying it is not supported yet and, where there is one, what to use
instead. A field in neither schema is unknown: `UnknownFields` logs its name once per server
process and the request goes on without it, as in vLLM.
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
        "use_beam_search",
        _is_false,
        "the server has no beam search yet (offline, LLM.beam_search has it); sample n choices, or decode "
        "greedily with temperature 0",
    ),
    UnsupportedField(
        "length_penalty",
        lambda value, _: value == 1.0,
        "length_penalty applies to beam search, which the server does not have yet",
    ),
    UnsupportedField(
        "prompt_embeds",
        _is_none,
        "kvflow takes prompts as text or token ids only",
    ),
)


def refuse_unsupported_fields(request: SamplingFields) -> None:
    """400 naming the first field of `request` that kvflow declares but does not implement yet, sent with a value
    other than its off one (the table above, in its order)."""
    declared = type(request).model_fields
    for field in UNSUPPORTED_FIELDS:
        if field.name not in declared:
            continue
        value = getattr(request, field.name)
        if not field.is_off(value, request):
            raise OpenAIServingError(
                f"{field.name} is not supported by kvflow yet: {field.why}", param=field.name
            )


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
