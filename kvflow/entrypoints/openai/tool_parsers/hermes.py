"""The `hermes` format (Hermes 2 Pro, Qwen2.5 and Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Each call is its own block; text between and around blocks is content. A block left open at the end of the output
(the model stopped right after the JSON) is still a call when its JSON is one. A block that is not a call (JSON that
does not parse, no string "name", arguments that are not an object) is content, verbatim, on its own: the other
blocks of the output are still calls.
"""

from __future__ import annotations

from typing import ClassVar

from kvflow.entrypoints.openai.tool_parsers.base import (
    BlockStart,
    ParsedCall,
    ToolParser,
    arguments_json,
    find_marker,
    load_json,
)

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """Calls in `<tool_call>` ... `</tool_call>` blocks, one JSON object `{"name", "arguments"}` each. Arguments may
    be an object or a JSON string holding one; missing arguments are an empty object."""

    name: ClassVar[str] = "hermes"
    # Hermes 2 Pro's checkpoints mark <tool_call> and </tool_call> as special tokens (Qwen's do not; keeping special
    # tokens changes nothing there), as vLLM does for this parser.
    keeps_special_tokens: ClassVar[bool] = True

    def find_block_start(self, text: str, at_output_start: bool) -> BlockStart:
        return find_marker(text, CALL_START)

    def find_block_end(self, block: str) -> int | None:
        end = block.find(CALL_END, len(CALL_START))
        return None if end < 0 else end + len(CALL_END)

    def parse_block(self, block: str) -> list[ParsedCall] | None:
        body = block[len(CALL_START) :]
        if body.endswith(CALL_END):
            body = body[: -len(CALL_END)]
        try:
            call = load_json(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        arguments = arguments_json(call.get("arguments", {}))
        if arguments is None:
            return None
        return [ParsedCall(call["name"], arguments)]
