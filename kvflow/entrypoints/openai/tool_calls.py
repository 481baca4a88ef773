"""Tool calling on /v1/chat/completions, vLLM's contract: which `tool_choice` a request has, the constraint it sets,
and how a reply's text becomes `tool_calls`.

`tool_choice` (None means "auto" when the request has `tools`, else "none"):

  * "none": the tools reach the chat template; the reply is plain content, never parsed.
  * "auto": the model writes freely and the server's `--tool-call-parser` extracts calls from its text; it needs
    `--enable-auto-tool-choice` and a parser (a 400 naming both flags otherwise, as vLLM says).
  * "required": the reply is constrained (structured outputs) to a JSON array of `{"name", "parameters"}` objects,
    each `parameters` valid under its tool's schema: at least one call, exactly one with `parallel_tool_calls`
    false. It works with any model and needs no parser.
  * a named function (`{"type": "function", "function": {"name": ...}}`): the reply is constrained to that
    function's `parameters` schema and is the call's `arguments`.

Forced calls ("required", named) are parsed by `RequiredToolCallsParser` and `NamedToolCallParser`, which have the
tool parsers' interface (`CallParser`: `extract_tool_calls`, `stream`), so one code path turns any reply into
content and calls, whole or streamed, with the same invariant: the pieces of a stream assemble into exactly what the
whole text parses to.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.tool_parsers import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.utils import short_repr

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set: start the server '
    'with both (e.g. --enable-auto-tool-choice --tool-call-parser hermes), or send tool_choice "required", a '
    'named function, or "none"'
)
# A tool without `parameters` takes none (OpenAI's rule).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class CallStream(Protocol):
    """One output's streaming state (`tool_parsers.ToolCallStream` is one)."""

    def push(self, delta_text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta: ...


class CallParser(Protocol):
    """What turns a reply into content and calls (every `ToolParser`, and the forced-call parsers below), with the
    tool parsers' streaming invariant."""

    keeps_special_tokens: bool

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls: ...

    def stream(self) -> CallStream: ...


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool choice, checked: `mode` is one of NONE, AUTO, REQUIRED, NAMED; `functions` are the
    request's tools' `function` objects, each with a string `name` and a dict `parameters`; `function_name` is
    the named function (NAMED only, and one of `functions`); `parallel` is `parallel_tool_calls`."""

    mode: str
    functions: tuple[Mapping[str, Any], ...] = ()
    function_name: str | None = None
    parallel: bool = True

    def forced_call(self) -> str | None:
        """This choice as explanations name a forced call ("'required'", "function 'name'"); None for "none" and
        "auto"."""
        if self.mode == NAMED:
            return f"function {self.function_name!r}"
        return repr(REQUIRED) if self.mode == REQUIRED else None

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint of a forced call (None for "none" and "auto")."""
        if self.mode == NAMED:
            return StructuredOutputsParams(
                json=dict(self._function(self.function_name)["parameters"])
            )
        if self.mode != REQUIRED:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": function["parameters"],
                },
                "required": ["name", "parameters"],
            }
            for function in self.functions
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def reply_parser(self, auto_parser: ToolParser | None) -> CallParser | None:
        """What extracts calls from the reply: the server's parser for "auto", a forced-call parser for
        "required" and named, nothing for "none"."""
        if self.mode == AUTO:
            return auto_parser
        if self.mode == REQUIRED:
            return RequiredToolCallsParser(names={function["name"] for function in self.functions})
        if self.mode == NAMED:
            assert self.function_name is not None
            return NamedToolCallParser(self.function_name)
        return None

    def _function(self, name: str | None) -> Mapping[str, Any]:
        return next(function for function in self.functions if function["name"] == name)


def resolve_tool_choice(
    tools: Sequence[Any] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None,
    auto_enabled: bool,
) -> ToolChoice:
    """The request's `ToolChoice` (its `tools`, `tool_choice` and `parallel_tool_calls` fields); `auto_enabled`:
    the server has `--enable-auto-tool-choice` and a `--tool-call-parser`. A 400 naming the field for: a tool
    that is not a function tool with a name, a tool_choice other than "none" without tools, an unknown
    tool_choice, a named function that is not among the tools, or "auto" on a server without auto tool choice."""
    functions = _check_tools(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = AUTO if functions else NONE
    if tool_choice == NONE:
        return ToolChoice(NONE, functions, parallel=parallel)
    if not functions:
        raise OpenAIServingError(
            f"tool_choice {short_repr(tool_choice)} needs tools: send the functions in 'tools'",
            param="tool_choice",
        )
    if tool_choice == AUTO:
        if not auto_enabled:
            raise OpenAIServingError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolChoice(AUTO, functions, parallel=parallel)
    if tool_choice == REQUIRED:
        return ToolChoice(REQUIRED, functions, parallel=parallel)
    name = _named_function(tool_choice)
    names = [function["name"] for function in functions]
    if name not in names:
        raise OpenAIServingError(
            f"tool_choice names the function {name!r}, which is not among the tools {names}",
            param="tool_choice",
        )
    return ToolChoice(NAMED, functions, function_name=name, parallel=parallel)


def _check_tools(tools: Sequence[Any] | None) -> tuple[Mapping[str, Any], ...]:
    """The tools' `function` objects, each with `parameters`: a JSON schema of an object (none or one without a
    `type`, such as `{}`, is taken as an object schema, so a forced call's arguments are always an object)."""
    functions: list[Mapping[str, Any]] = []
    for index, tool in enumerate(tools or ()):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(function, Mapping)
        ):
            raise OpenAIServingError(
                f"{where} must be a function tool such as {{'type': 'function', 'function': {{'name': "
                f"'get_weather', 'parameters': {{...}}}}}}, got {short_repr(tool)}",
                param="tools",
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIServingError(f"{where}.function needs a 'name' string", param="tools")
        parameters = function.get("parameters", _NO_PARAMETERS)
        if parameters is None:
            parameters = _NO_PARAMETERS
        if not isinstance(parameters, Mapping):
            raise OpenAIServingError(
                f"{where}.function.parameters must be a JSON schema object, got {short_repr(parameters)}",
                param="tools",
            )
        if "type" not in parameters:  # arguments are always an object ({} means "no parameters")
            parameters = {**_NO_PARAMETERS, **parameters}
        functions.append({**function, "parameters": parameters})
    names = [function["name"] for function in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise OpenAIServingError(f"tools name {duplicates} more than once", param="tools")
    return tuple(functions)


def _named_function(tool_choice: str | Mapping[str, Any]) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (
        not isinstance(tool_choice, Mapping)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise OpenAIServingError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': "
            f"...}}, got {short_repr(tool_choice)}",
            param="tool_choice",
        )
    return name


# ---------------------------------------------------------------------------------------------------- forced calls
def _call_id() -> str:
    """vLLM's call id form: "chatcmpl-tool-" and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class NamedToolCallParser:
    """A reply constrained to one function's parameters: the whole text is that call's `arguments`, streamed as it
    comes (the first piece with the call's id and name). An empty reply makes no call."""

    keeps_special_tokens = False

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if not text:
            return ExtractedToolCalls([], None)
        return ExtractedToolCalls([ToolCall(_call_id(), self.function_name, text)], None)

    def stream(self) -> CallStream:
        return _NamedCallStream(self.function_name)


class _NamedCallStream:
    def __init__(self, function_name: str) -> None:
        self.function_name = function_name
        self.started = False

    def push(self, delta_text: str) -> StreamDelta:
        if not delta_text:
            return StreamDelta("", [])
        if self.started:
            return StreamDelta("", [ToolCallDelta(0, None, None, delta_text)])
        self.started = True
        first = ToolCallDelta(0, _call_id(), self.function_name, delta_text)
        return StreamDelta("", [first])

    def finish(self) -> StreamDelta:
        return StreamDelta("", [])


class RequiredToolCallsParser:
    """A reply constrained to `[{"name": ..., "parameters": {...}}, ...]`: each complete element whose name is one
    of `names` and whose parameters are an object is a call (`arguments`: the parameters re-serialised); the
    stream releases each call once its element has closed. A reply cut short (finish_reason "length") keeps the
    calls that closed, and the text after them (the unclosed call, from its `{`, or the whole reply when no call
    closed) becomes `content`, so nothing generated is lost (vLLM returns a cut forced reply as content); the same
    way whole and streamed. A complete reply has no content."""

    keeps_special_tokens = False

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        stream = self.stream()
        pushed, final = stream.push(text), stream.finish()
        deltas = [*pushed.tool_calls, *final.tool_calls]
        return ExtractedToolCalls(
            [ToolCall(delta.id or "", delta.name or "", delta.arguments) for delta in deltas],
            (pushed.content + final.content) or None,
        )

    def stream(self) -> CallStream:
        return _ArrayElementStream(self.names)


class _ArrayElementStream:
    """Finds the top-level objects of a JSON array as its text arrives (depth and string state carried across
    pieces), parsing each once its closing brace is seen.

    Invariant: `buffer[:scanned]` has been scanned; `element_start` is the index of the current top-level object's
    `{` in `buffer` (None between elements); `buffer[:consumed]` is the text of the calls released (their
    elements) or the whole array once its `]` closed it: what `finish` returns as content is the rest.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.buffer = ""
        self.scanned = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.element_start: int | None = None
        self.num_calls = 0
        self.consumed = 0

    def push(self, delta_text: str) -> StreamDelta:
        self.buffer += delta_text
        calls: list[ToolCallDelta] = []
        for index in range(self.scanned, len(self.buffer)):
            char = self.buffer[index]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
                if char == "{" and self.depth == 2:
                    self.element_start = index
            elif char in "}]":
                self.depth -= 1
                if char == "}" and self.depth == 1 and self.element_start is not None:
                    call = self._call(self.buffer[self.element_start : index + 1])
                    if call is not None:
                        calls.append(call)
                        self.consumed = index + 1
                    self.element_start = None
                elif char == "]" and self.depth == 0:
                    self.consumed = len(self.buffer)
        self.scanned = len(self.buffer)
        return StreamDelta("", calls)

    def finish(self) -> StreamDelta:
        """The text after the released calls when the array never closed (a cut reply), without the `,` and
        whitespace that separated it from the last call; "" for a complete reply."""
        rest = self.buffer[self.consumed :]
        if self.num_calls:
            rest = rest.lstrip(", \t\r\n")
        return StreamDelta(rest if rest.strip() else "", [])

    def _call(self, element: str) -> ToolCallDelta | None:
        try:
            value = json.loads(element)
        except ValueError:
            return None
        name, parameters = value.get("name"), value.get("parameters")
        if name not in self.names or not isinstance(parameters, dict):
            return None
        arguments = json.dumps(parameters, ensure_ascii=False)
        self.num_calls += 1
        return ToolCallDelta(self.num_calls - 1, _call_id(), name, arguments)
