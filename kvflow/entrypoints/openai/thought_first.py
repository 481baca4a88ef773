"""A forced tool call ("required" or a named function) that lets the model think first, under a reasoning parser.

The engine starts a constraint where the reasoning ends (`kvflow.structured_output.reasoning_end`): a prompt that
opens the thought (Qwen3-Thinking's template ends with `<think>\\n`) gets a free thought, then the call. A prompt
that does not (Qwen3's own template, where the model opens `<think>` itself) would have the call's JSON from the
first token, leaving the model no room to think. For that prompt `thought_then_call` turns the call's JSON-schema
constraint into one with an optional thought first: the parser's start marker, any text without its end marker,
the end marker and a few whitespace characters, then the call (an xgrammar structural tag). The reply parser reads
that thought as reasoning, as it reads a free one.
"""

from __future__ import annotations

import json
from typing import Any

from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured_output.backend import MAX_JSON_WHITESPACE


def thought_then_call(
    constraint: StructuredOutputsParams, start_marker: str, end_marker: str
) -> StructuredOutputsParams:
    """`constraint` (a forced call's JSON schema) after one optional `start_marker` ... `end_marker` thought."""
    if constraint.json is None:
        raise ValueError("a forced call's constraint is a JSON schema")
    schema = constraint.json if isinstance(constraint.json, dict) else json.loads(constraint.json)
    thought: dict[str, Any] = {
        "type": "sequence",
        "elements": [
            {
                "type": "tag",
                "begin": start_marker,
                "content": {"type": "any_text"},
                "end": end_marker,
            },
            {"type": "regex", "pattern": f"[ \\t\\r\\n]{{0,{MAX_JSON_WHITESPACE}}}"},
        ],
    }
    call = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [{"type": "optional", "content": thought}, call],
        },
    }
    return StructuredOutputsParams(structural_tag=json.dumps(tag))
