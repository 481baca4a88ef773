"""The `llama3_json` format (Llama 3.1 / 3.2 JSON tool calling): the whole output is the calls.

After optional whitespace and an optional `<|python_tag|>`, the output is one or more JSON objects
`{"name": ..., "parameters": {...}}` ("arguments" is accepted for "parameters") separated by `;`. An output that
does not start with `{` there is content; one that does but is not entirely such calls is content too, verbatim.
"""

from __future__ import annotations

from typing import ClassVar

from kvflow.entrypoints.openai.tool_parsers.base import (
    WHITESPACE,
    BlockStart,
    ParsedCall,
    ToolParser,
    arguments_json,
    decode_json_prefix,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(ToolParser):
    """Calls as `;`-separated JSON objects making up the whole output. The block is the whole output and runs to
    its end; which it is, content or calls, is decided only then. An object needs a string "name" and a
    "parameters" (or "arguments") object: a plain JSON answer such as `{"name": "Ada"}` stays content."""

    name: ClassVar[str] = "llama3_json"

    def find_block_start(self, text: str, at_output_start: bool) -> BlockStart:
        if not at_output_start:
            return BlockStart(None, len(text))
        rest = text.lstrip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(rest):
            return BlockStart(None, 0)
        if not rest:
            return BlockStart(None, 0)
        return BlockStart(0) if rest.startswith("{") else BlockStart(None, len(text))

    def parse_block(self, block: str) -> list[ParsedCall] | None:
        position = WHITESPACE.match(block).end()
        if block.startswith(PYTHON_TAG, position):
            position += len(PYTHON_TAG)
        calls: list[ParsedCall] = []
        while True:
            try:
                value, position = decode_json_prefix(block, position)
            except ValueError:
                return None
            call = parse_call(value)
            if call is None:
                return None
            calls.append(call)
            position = WHITESPACE.match(block, position).end()
            if position == len(block):
                return calls
            if not block.startswith(SEPARATOR, position):
                return None
            position += len(SEPARATOR)


def parse_call(value: object) -> ParsedCall | None:
    """One `{"name", "parameters" | "arguments"}` object as a call; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = "parameters" if "parameters" in value else "arguments"
    if key not in value:
        return None
    arguments = arguments_json(value[key])
    return None if arguments is None else ParsedCall(value["name"], arguments)
