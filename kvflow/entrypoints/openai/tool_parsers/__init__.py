"""Tool-call parsers: read the calls out of a model's output, whole or streamed (vLLM's `--tool-call-parser`).

    base.py          the shapes (ToolCall, ExtractedToolCalls, ToolCallDelta, StreamDelta), the ToolParser base
                     class and the one streaming scan every format shares (ToolCallStream)
    hermes.py        `<tool_call>{...}</tool_call>` blocks (Hermes 2 Pro, Qwen2.5, Qwen3)
    llama3_json.py   the whole output as `;`-separated JSON calls (Llama 3.1 / 3.2)
    mistral.py       `[TOOL_CALLS]` and a JSON array, or `name[ARGS]{...}` groups (Mistral, v11 tokenizers on)
    pythonic.py      the whole output as a Python list of calls (Llama 3.2 / 4)

Parsers are registered in `TOOL_PARSERS` (the one registry shape) and imported only when used.
"""

from __future__ import annotations

from kvflow.entrypoints.openai.tool_parsers.base import (
    BlockStart,
    ExtractedToolCalls,
    ParsedCall,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from kvflow.registry import LazyRegistry

TOOL_PARSERS: LazyRegistry[type[ToolParser]] = LazyRegistry(
    "tool call parser",
    {
        "hermes": "kvflow.entrypoints.openai.tool_parsers.hermes:HermesToolParser",
        "llama3_json": "kvflow.entrypoints.openai.tool_parsers.llama3_json:Llama3JsonToolParser",
        "mistral": "kvflow.entrypoints.openai.tool_parsers.mistral:MistralToolParser",
        "pythonic": "kvflow.entrypoints.openai.tool_parsers.pythonic:PythonicToolParser",
    },
)

__all__ = [
    "TOOL_PARSERS",
    "BlockStart",
    "ExtractedToolCalls",
    "ParsedCall",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
]
