"""Responses API items <-> the chat conversation kvflow renders and parses.

Input: a request's `input` (a string, or items) becomes chat messages for the one chat renderer
(`chat_prompt.ChatPromptRenderer`): a string is one user message; a `message` item (`role` user, assistant, system
or developer, rendered as system; `content` a string or `input_text` / `output_text` / `refusal` parts) one message;
consecutive `function_call` items one assistant message with `tool_calls` (joined to the assistant message right
before them, as a chat reply holds its text and its calls); a `function_call_output` item a `tool` message; a
`reasoning` item's text becomes the `reasoning_content` (and `reasoning`) of the assistant message that follows it,
as reasoning templates (Qwen3's) read it. Responses' flat function tools (`{"type": "function", "name", ...}`)
and tool choices (`{"type": "function", "name"}`) become chat's nested ones, so `tool_calls.resolve_tool_choice`
checks them. Every refusal is a 400 naming the field (`input`, `tools`, `tool_choice`, `text`).

Output: a parsed reply (`chat_reply.ReplyParser`'s `ChatMessage`) becomes output items: a `reasoning` item, a
`message` item with one `output_text` part, then one `function_call` item per call; and the other way, those items
become the assistant message a follow-up (`previous_response_id`) continues from.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol import JsonSchemaResponseFormat, ResponseFormat
from kvflow.utils import short_repr

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.protocol import ChatMessage

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def item_id(prefix: str) -> str:
    """An output item's id in OpenAI's form: `msg_…`, `fc_…`, `rs_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------------- input
def input_messages(request_input: str | Sequence[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input` (see the module docstring)."""
    if isinstance(request_input, str):
        return [{"role": "user", "content": request_input}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = (
        None  # a reasoning item's text, waiting for the assistant message it belongs to
    )
    for index, item in enumerate(request_input):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise _bad_input(f"{where} must be an object (an input item), got {short_repr(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(where, item)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"] = message["reasoning"] = reasoning
                reasoning = None
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(where, item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"] = message["reasoning"] = reasoning
                    reasoning = None
                messages.append(message)
        elif kind == "function_call_output":
            messages.append(_function_call_output(where, item))
        elif kind == "reasoning":
            reasoning = _reasoning_text(where, item)
        else:
            raise _bad_input(
                f"{where} has type {short_repr(kind)}; kvflow takes message, function_call, "
                "function_call_output and reasoning items"
            )
    return messages


def input_item_list(request_input: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A request's input (already checked by `input_messages`) as the items OpenAI lists for a response: each with
    an `id` (its own, or a new one) and a `type`, a message's string content as one text part."""
    items = (
        [{"role": "user", "content": request_input}]
        if isinstance(request_input, str)
        else request_input
    )
    listed = []
    for item in items:
        kind = item.get("type", "message")
        entry = {
            "id": item.get("id") or item_id(_ID_PREFIXES[kind]),
            "type": kind,
            **{key: value for key, value in item.items() if key not in ("id", "type")},
        }
        content = entry.get("content")
        if kind == "message" and isinstance(content, str):
            is_output = entry.get("role") == "assistant"
            entry["content"] = [
                output_text_part(content) if is_output else {"type": "input_text", "text": content}
            ]
        entry.setdefault("status", "completed")
        listed.append(entry)
    return listed


def _message(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise _bad_input(
            f"{where}.role must be one of {sorted(_ROLES)}, got {short_repr(item.get('role'))}"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise _bad_input(f"{where}.content must be a string or a list of text parts")
    parts = []
    for part_index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = _TEXT_PARTS.get(kind)  # type: ignore[arg-type]
        text = part.get(key) if key is not None else None  # type: ignore[union-attr]
        if not isinstance(text, str):
            raise _bad_input(
                f"{where}.content[{part_index}] must be a text part ({{'type': 'input_text', 'text': ...}}; "
                f"kvflow serves text models only), got {short_repr(part)}"
            )
        parts.append({"type": "text", "text": text})
    return {"role": role, "content": parts}


def _function_call(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    fields = {name: item.get(name) for name in ("call_id", "name", "arguments")}
    missing = [name for name, value in fields.items() if not isinstance(value, str)]
    if missing:
        raise _bad_input(f"{where} (a function_call) needs {', '.join(missing)} (strings)")
    return {
        "id": fields["call_id"],
        "type": "function",
        "function": {"name": fields["name"], "arguments": fields["arguments"]},
    }


def _function_call_output(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise _bad_input(f"{where} (a function_call_output) needs call_id (a string)")
    if isinstance(output, list):
        output = _message(f"{where}.output", {"role": "user", "content": output})["content"]
    elif not isinstance(output, str):
        raise _bad_input(f"{where}.output must be a string or a list of text parts")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(where: str, item: Mapping[str, Any]) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary (what a client passes back)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise _bad_input(f"{where}.{key} must be a list of {kind} parts")
        texts = [part.get("text") for part in parts if isinstance(part, Mapping)]
        if any(not isinstance(text, str) for text in texts) or len(texts) != len(parts):
            raise _bad_input(f"{where}.{key} must be a list of {{'type': '{kind}', 'text': ...}}")
        if texts:
            return "\n".join(texts)
    return ""


def _bad_input(message: str) -> OpenAIServingError:
    return OpenAIServingError(message, param="input")


# ---------------------------------------------------------------------------------------------------- tools
def chat_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's (`{"type": "function", "function": {...}}`); a tool of another type
    (web_search, file_search, mcp, ...) is a 400 naming `tools`."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise OpenAIServingError(
                f"tools[{index}] must be a function tool such as {{'type': 'function', 'name': 'get_weather', "
                f"'parameters': {{...}}}} (kvflow runs no built-in tools), got {short_repr(tool)}",
                param="tools",
            )
        function = {key: value for key, value in tool.items() if key != "type"}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(tool_choice: str | Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' `tool_choice` as chat's: the modes as they are, `{"type": "function", "name"}` nested."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    name = tool_choice.get("name")
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIServingError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}, got "
            f"{short_repr(tool_choice)}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def response_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools as a response echoes them (OpenAI's `FunctionTool`: `strict` and `parameters` set)."""
    return [
        {"strict": None, "parameters": None, "description": None, **tool} for tool in tools or ()
    ]


# ---------------------------------------------------------------------------------------------------- text.format
def text_response_format(text: Mapping[str, Any] | None) -> ResponseFormat | None:
    """`text.format` as chat's `response_format` (None: plain text): `{"type": "json_schema", "name", "schema",
    "strict"}` or `{"type": "json_object"}`. 400 naming `text` for another type or a json_schema without one."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise OpenAIServingError(f"text has unknown keys {unknown}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise OpenAIServingError(
            "text.verbosity is not supported by kvflow: the model writes as it writes; drop it",
            param="text",
        )
    text_format = text.get("format")
    kind = text_format.get("type") if isinstance(text_format, Mapping) else None
    if text_format is None or kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(type="json_object")
    if kind != "json_schema":
        raise OpenAIServingError(
            "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'name': "
            f"..., 'schema': {{...}}}}, got {short_repr(text_format)}",
            param="text",
        )
    assert isinstance(text_format, Mapping)
    schema = text_format.get("schema")
    if not isinstance(schema, Mapping):
        raise OpenAIServingError(
            "text.format of type json_schema needs its JSON schema in text.format.schema",
            param="text",
        )
    return ResponseFormat(
        type="json_schema",
        json_schema=JsonSchemaResponseFormat(
            name=text_format.get("name"),
            description=text_format.get("description"),
            schema=dict(schema),
            strict=text_format.get("strict"),
        ),
    )


# ---------------------------------------------------------------------------------------------------- output
def output_items(message: ChatMessage, status: str) -> list[dict[str, Any]]:
    """A parsed reply as output items: its reasoning, its text (when it has some, or when it is nothing else),
    then its calls. Every item is "completed" but the last, which has `status` ("incomplete" for a reply cut
    short: the item it was cut in), as a stream closes them."""
    items: list[dict[str, Any]] = []
    if message.reasoning is not None:
        items.append(reasoning_item(item_id("rs"), message.reasoning, "completed"))
    if message.content is not None or not (message.tool_calls or message.reasoning):
        items.append(message_item(item_id("msg"), message.content or "", "completed"))
    for call in message.tool_calls:
        items.append(
            function_call_item(
                item_id("fc"), call.id, call.function.name, call.function.arguments, "completed"
            )
        )
    items[-1]["status"] = status
    return items


def message_item(identifier: str, text: str | None, status: str) -> dict[str, Any]:
    """A `message` output item; `text` None: just opened (no part yet)."""
    content = [] if text is None else [output_text_part(text)]
    return {
        "id": identifier,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(identifier: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [reasoning_text_part(text)]
    return {
        "id": identifier,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(
    identifier: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": identifier,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_messages(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up continues from (they are valid input items;
    a reply that is only reasoning, cut short in it, is an assistant message with no text)."""
    if all(item["type"] == "reasoning" for item in items):
        items = [*items, message_item(item_id("msg"), "", "completed")]
    return input_messages(list(items))
