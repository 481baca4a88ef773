"""The `pythonic` format (Llama 3.2 and Llama 4): the whole output is a Python list of calls.

`[get_weather(city="Paris"), get_time()]`, stripped, optionally inside `<|python_start|>` ... `<|python_end|>`:
keyword arguments only, each a literal (strings, numbers, True/False/None, and lists, tuples and dicts of them),
turned into JSON (tuples become arrays; True/False/None become true/false/null). Any other output is content.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any, ClassVar

from kvflow.entrypoints.openai.tool_parsers.base import BlockStart, ParsedCall, ToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class PythonicToolParser(ToolParser):
    """Calls as one Python list literal of calls, making up the whole output. The block is the whole output once
    it starts (after whitespace) with `[` or `<|python_start|>`; it runs to the end, where it is parsed with `ast`
    (never evaluated)."""

    name: ClassVar[str] = "pythonic"

    def find_block_start(self, text: str, at_output_start: bool) -> BlockStart:
        if not at_output_start:
            return BlockStart(None, len(text))
        rest = text.lstrip()
        if rest.startswith(("[", PYTHON_START)):
            return BlockStart(0)
        return BlockStart(None, 0 if PYTHON_START.startswith(rest) else len(text))

    def parse_block(self, block: str) -> list[ParsedCall] | None:
        source = block.strip()
        source = source.removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls: list[ParsedCall] = []
        for node in tree.body.elts:
            call = parse_call(node)
            if call is None:
                return None
            calls.append(call)
        return calls


def parse_call(node: ast.expr) -> ParsedCall | None:
    """`name(key=literal, ...)` as a call; None for anything else (positional or repeated arguments, `**`)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            return None
        try:
            arguments[keyword.arg] = literal_json(keyword.value)
        except (ValueError, RecursionError):
            return None
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


def literal_json(node: ast.expr) -> Any:
    """The JSON value of a Python literal; ValueError for what JSON cannot hold (bytes, complex, sets, inf, nan,
    non-string dict keys) and for anything that is not a literal."""
    if isinstance(node, ast.Constant):
        return constant_json(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        if isinstance(node.operand, ast.Constant) and is_number(node.operand.value):
            value = node.operand.value
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError("a sign applies to numbers only")
    if isinstance(node, ast.List | ast.Tuple):
        return [literal_json(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        result: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                raise ValueError("dict keys must be strings")
            result[key.value] = literal_json(value)
        return result
    raise ValueError(f"not a literal: {type(node).__name__}")


def constant_json(value: object) -> Any:
    """A constant JSON can hold: a string, None, a bool or a finite int or float."""
    if value is None or isinstance(value, str | bool) or is_number(value):
        return value
    raise ValueError(f"{type(value).__name__} is not JSON")


def is_number(value: object) -> bool:
    """An int or a finite float, not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
