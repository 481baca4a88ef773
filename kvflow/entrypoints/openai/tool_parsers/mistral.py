"""The `mistral` format: content, then `[TOOL_CALLS]` and the calls, to the end of the output.

Two spellings of the calls: a JSON array of `{"name", "arguments"}` objects after one `[TOOL_CALLS]` (tokenizers
before v11), or one `[TOOL_CALLS]name[ARGS]{...}` group per call (v11 and later). Text before the first
`[TOOL_CALLS]` is content; a call section that is not entirely one of the two is content, verbatim.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import ClassVar

from kvflow.entrypoints.openai.tool_parsers.base import (
    WHITESPACE,
    BlockStart,
    ParsedCall,
    ToolParser,
    arguments_json,
    decode_json_prefix,
    find_marker,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
# A v11 call's function name, between [TOOL_CALLS] and [ARGS] (surrounding whitespace allowed).
FUNCTION_NAME = re.compile(r"\s*([\w.\-]+)\s*")
CALL_ID_ALPHABET = string.ascii_letters + string.digits
CALL_ID_LENGTH = 9


class MistralToolParser(ToolParser):
    """Calls after `[TOOL_CALLS]`, a special token (kept in the detokenized text). The block runs from the first
    marker to the end of the output. Call ids are 9 letters and digits, the only ids Mistral's chat templates
    accept back."""

    name: ClassVar[str] = "mistral"
    keeps_special_tokens: ClassVar[bool] = True

    def new_call_id(self) -> str:
        return "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(CALL_ID_LENGTH))

    def find_block_start(self, text: str, at_output_start: bool) -> BlockStart:
        return find_marker(text, TOOL_CALLS)

    def parse_block(self, block: str) -> list[ParsedCall] | None:
        after_marker = WHITESPACE.match(block, len(TOOL_CALLS)).end()
        if block.startswith("[", after_marker):
            return parse_json_array(block, after_marker)
        return parse_name_args_groups(block)


def parse_json_array(block: str, position: int) -> list[ParsedCall] | None:
    """`[{"name", "arguments"}, ...]` from `position` to the end of `block` (trailing whitespace allowed)."""
    try:
        value, end = decode_json_prefix(block, position)
    except ValueError:
        return None
    if WHITESPACE.match(block, end).end() != len(block) or not isinstance(value, list) or not value:
        return None
    calls: list[ParsedCall] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        arguments = arguments_json(item.get("arguments", {}))
        if arguments is None:
            return None
        calls.append(ParsedCall(item["name"], arguments))
    return calls


def parse_name_args_groups(block: str) -> list[ParsedCall] | None:
    """`[TOOL_CALLS]name[ARGS]{...}` groups, one after another, filling `block` (whitespace between allowed)."""
    calls: list[ParsedCall] = []
    position = 0
    while position < len(block):
        if not block.startswith(TOOL_CALLS, position):
            return None
        name = FUNCTION_NAME.match(block, position + len(TOOL_CALLS))
        if name is None or not block.startswith(ARGS, name.end()):
            return None
        try:
            value, position = decode_json_prefix(block, name.end() + len(ARGS))
        except ValueError:
            return None
        arguments = arguments_json(value)
        if arguments is None:
            return None
        calls.append(ParsedCall(name.group(1), arguments))
        position = WHITESPACE.match(block, position).end()
    return calls or None
