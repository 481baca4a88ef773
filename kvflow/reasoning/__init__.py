"""Reasoning parsers (`--reasoning-parser NAME`): where a model's `<think>` reasoning ends and its answer begins.

    base.py         `ReasoningParser`, `ReasoningSplit`, `ReasoningStream`: the one split rule, whole or streamed
    qwen3.py        `qwen3`: reasoning only if the prompt leaves `<think>` open or the output opens it
    deepseek_r1.py  `deepseek_r1`: reasoning from the start unless the prompt closed it

The API server splits `message.reasoning` from `message.content` with them; the engine core starts a structured-
output constraint where they say the reasoning ends (`kvflow.structured_output.reasoning_end`). Parsers are
registered in `REASONING_PARSERS` (the one registry shape) and imported only when looked up.
"""

from __future__ import annotations

from kvflow.reasoning.base import ReasoningParser, ReasoningSplit, ReasoningStream
from kvflow.registry import LazyRegistry

REASONING_PARSERS: LazyRegistry[type[ReasoningParser]] = LazyRegistry(
    "reasoning parser",
    {
        "qwen3": "kvflow.reasoning.qwen3:Qwen3ReasoningParser",
        "deepseek_r1": "kvflow.reasoning.deepseek_r1:DeepSeekR1ReasoningParser",
    },
)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningStream"]
