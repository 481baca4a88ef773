"""The one chat renderer: a conversation -> the prompt text its chat template makes -> the prompt's token ids.

`LLM.chat`, `kvflow chat`, `/v1/chat/completions` and `/tokenize` all render through here, so one conversation makes
the same prompt on every path. `render_chat` does, in order:

  * `chat_template` (`load_chat_template`, vLLM's rule): the name of an existing file is read; otherwise it is the
    template's own text, or the name of one of the checkpoint's templates; a value that is neither (no `{`, `}` or
    newline, so it looks like a path) is an error. None: the checkpoint's default template.
  * messages (`normalize_messages`): a non-empty list of dicts, each with a string `role`; system, user, assistant,
    tool and any other role reach the template as they come, with every other key (`tool_calls`, `tool_call_id`,
    `name`, ...) kept. `content` is a string, or a list of `{"type": "text", "text": ...}` parts joined with
    newlines (vLLM's "string" content format; other part types are refused: kvflow serves text models). An
    assistant message with `tool_calls` may have no content (rendered as ""), and its calls' JSON-string
    `arguments` are parsed to objects, as vLLM does for tool-use templates.
  * the template sees `messages`, `tools`, `add_generation_prompt`, the special tokens (`bos_token`, ...) and
    `chat_template_kwargs`, which may not set the first three.
  * `continue_final_message` (vLLM's and transformers' semantics): the last message is a prefix that the model
    continues: the text ends right after its content, with no end-of-turn and no generation prompt. It excludes
    `add_generation_prompt` (both true is an error).
  * the text is encoded without adding special tokens (the template placed them).

Every bad input is a `ChatInputError` (a ValueError) naming the argument at fault, and the place inside it
(`messages[2] (role 'user'): content[0] ...`); a template that fails is a `ChatTemplateError`. The caller's
messages are never changed. The server renders templates that clients send in a sandbox process: it calls
`prepare_chat` (every step above up to the template), renders `PreparedChat.source` there, and finishes with
`PreparedChat.finish`, the very steps `render_chat` takes in-process. `prepare_chat` never reads files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.tokenizer.tokenizer import Tokenizer

# A chat template given as a string is the template itself when it holds one of these (vLLM's rule).
JINJA_CHARS = "{}\n"
# Template variables set by the renderer's own arguments, which `chat_template_kwargs` may not set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template"}
)
_EXAMPLE_MESSAGE = "{'role': 'user', 'content': 'Hi'}"
_TEXT_PART = "{'type': 'text', 'text': ...}"


class ChatInputError(ValueError):
    """A conversation or rendering option that cannot be rendered. `field` is the argument (the request field, on
    the server) at fault: "messages", "tools", "chat_template", "chat_template_kwargs" or
    "continue_final_message"; the message names the exact place."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation. Invariant: `prompt_token_ids` is `prompt_text` encoded without adding special
    tokens (the template placed them)."""

    prompt_text: str
    prompt_token_ids: list[int]

    def as_prompt(self) -> dict[str, Any]:
        """The prompt as `LLM.generate` and `AsyncLLM.generate` take it (text and token ids)."""
        return {"prompt": self.prompt_text, "prompt_token_ids": list(self.prompt_token_ids)}


@dataclass(frozen=True)
class PreparedChat:
    """A checked conversation ready for its template: rendering `source` with `variables` gives the text that
    `finish` turns into the prompt text.

    Invariants: `variables` hold JSON values only (they may be sent to a sandbox process); `final_message` is the
    content being continued when `continue_final_message` was asked for, else None.
    """

    source: str
    variables: dict[str, Any]
    final_message: str | None = None

    def render(self, tokenizer: Tokenizer) -> str:
        """The prompt text, rendered in this process."""
        return self.finish(tokenizer.render_template(self.source, self.variables))

    def finish(self, rendered: str) -> str:
        """The prompt text from the template's output: unchanged, or cut right after the continued final message
        (transformers' rule: where its stripped content last appears, keeping its leading whitespace as
        rendered)."""
        final = self.final_message
        if final is None:
            return rendered
        stripped = final.strip()
        if stripped not in rendered:
            raise ChatInputError(
                "continue_final_message",
                "continue_final_message is set, but the chat template's output does not contain the final "
                "message's content (the template changed it), so there is nothing to continue",
            )
        start = rendered.rindex(stripped)
        kept = final.lstrip()
        if rendered[start : start + len(kept)] == kept:
            return rendered[: start + len(kept)]
        return rendered[: start + len(stripped)]


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | os.PathLike[str] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> RenderedChat:
    """The prompt of a conversation: its text and token ids (see the module docstring for every step).

    `chat_template`: a template file, the template's text, or the name of one of the checkpoint's templates
    (None: the checkpoint's default). ChatInputError naming the argument at fault; ChatTemplateError when the
    template fails."""
    text = render_chat_text(
        tokenizer,
        messages,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
    )
    return RenderedChat(text, tokenizer.encode(text, add_special_tokens=False))


def render_chat_text(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | os.PathLike[str] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """`render_chat`'s prompt text, without encoding it."""
    prepared = prepare_chat(
        tokenizer,
        messages,
        chat_template=load_chat_template(
            chat_template, named_templates=tokenizer.named_chat_templates
        ),
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
    )
    return prepared.render(tokenizer)


def prepare_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> PreparedChat:
    """Every step of `render_chat` before the template renders: the options and messages checked and normalised,
    the template's source and variables. `chat_template` is a template's text or the name of one of the
    checkpoint's templates, never a file (what a server takes from a request)."""
    if continue_final_message and add_generation_prompt:
        raise ChatInputError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true: continue_final_message "
            "continues the last message, add_generation_prompt starts a new assistant message (set "
            "add_generation_prompt to false)",
        )
    checked_messages = normalize_messages(messages)
    variables = {
        **tokenizer.template_special_tokens,
        **_check_template_kwargs(chat_template_kwargs),
        "messages": checked_messages,
        "tools": _check_tools(tools),
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        source = tokenizer.chat_template_source(chat_template)
    except ValueError as error:
        raise ChatInputError("chat_template", str(error)) from error
    final_message = checked_messages[-1]["content"] if continue_final_message else None
    return PreparedChat(source, variables, final_message)


# ---------------------------------------------------------------------------------------------------- templates
def load_chat_template(
    chat_template: str | os.PathLike[str] | None, *, named_templates: Collection[str] = ()
) -> str | None:
    """A chat template as given to `LLM.chat`, `kvflow chat --chat-template` or `kvflow serve --chat-template`,
    by vLLM's rule: a path object, or a string naming an existing file, is read; a string with `{`, `}` or a
    newline is the template itself; so is one of `named_templates` (the checkpoint's, returned as the name). Any
    other string looks like a path to a file that does not exist: ChatInputError("chat_template"), as vLLM
    raises. None stays None (the checkpoint's default)."""
    if chat_template is None:
        return None
    if isinstance(chat_template, os.PathLike) or os.path.isfile(chat_template):
        return _read_template_file(Path(chat_template))
    if chat_template in named_templates or any(char in chat_template for char in JINJA_CHARS):
        return chat_template
    named = ", or one of the checkpoint's templates: " + ", ".join(sorted(named_templates))
    raise ChatInputError(
        "chat_template",
        f"chat_template {chat_template!r} looks like a file path, but there is no such file; give an "
        f"existing template file, or the template itself (Jinja text){named if named_templates else ''}",
    )


def _read_template_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatInputError(
            "chat_template", f"chat_template file {str(path)!r} cannot be read: {error}"
        ) from error


def _check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise ChatInputError(
            "chat_template_kwargs", "chat_template_kwargs must be a dict with string keys"
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ChatInputError(
            "chat_template_kwargs",
            f"chat_template_kwargs may not set {reserved}: use the arguments (request fields) of those names",
        )
    return dict(kwargs)


def _check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list | tuple) or not all(isinstance(tool, Mapping) for tool in tools):
        raise ChatInputError(
            "tools",
            "tools must be a list of JSON-schema dicts such as {'type': 'function', 'function': "
            "{'name': ..., 'parameters': {...}}} (Python callables are not converted)",
        )
    return list(tools)


# ---------------------------------------------------------------------------------------------------- messages
def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """The messages a template renders, checked and normalised (module docstring); copies, the caller's are never
    changed. ChatInputError("messages") naming the first bad place, such as `messages[1] (role 'user'):
    content[0]`."""
    if not isinstance(messages, list | tuple):
        raise ChatInputError(
            "messages",
            f"messages must be a list of messages such as {_EXAMPLE_MESSAGE}, got "
            f"{type(messages).__name__}",
        )
    if not messages:
        raise ChatInputError(
            "messages", f"messages must not be empty: give at least one, such as {_EXAMPLE_MESSAGE}"
        )
    return [_normalize_message(index, message) for index, message in enumerate(messages)]


def _normalize_message(index: int, message: object) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatInputError(
            "messages",
            f"messages[{index}] must be a dict such as {_EXAMPLE_MESSAGE}, got {type(message).__name__}",
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ChatInputError(
            "messages",
            f"messages[{index}] needs a 'role' string such as 'system', 'user', 'assistant' or 'tool', got "
            f"{role!r}",
        )
    where = f"messages[{index}] (role {role!r})"
    normalized = dict(message)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        normalized["tool_calls"] = _normalize_tool_calls(where, tool_calls)
    content = message.get("content")
    if content is None and tool_calls:
        normalized["content"] = ""
    else:
        normalized["content"] = _content_text(where, content)
    return normalized


def _content_text(where: str, content: object) -> str:
    """A message's content as text: a string as it is, text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if content is None:
        raise ChatInputError(
            "messages",
            f"{where} has no content: give it a 'content' string (\"\" for an empty message) or a list of "
            f"{_TEXT_PART} parts",
        )
    if not isinstance(content, list | tuple):
        raise ChatInputError(
            "messages",
            f"{where}: content must be a string or a list of {_TEXT_PART} parts, got "
            f"{type(content).__name__}",
        )
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if not isinstance(kind, str):
            raise ChatInputError(
                "messages",
                f"{where}: content[{index}] must be a dict with a 'type', such as {_TEXT_PART}, got {part!r}",
            )
        if kind != "text":
            raise ChatInputError(
                "messages",
                f"{where}: content[{index}] is a {kind!r} part; kvflow serves text models, so only "
                f"{_TEXT_PART} parts are supported",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatInputError(
                "messages",
                f"{where}: content[{index}] is a text part without a 'text' string (got "
                f"{type(text).__name__})",
            )
        texts.append(text)
    return "\n".join(texts)


def _normalize_tool_calls(where: str, tool_calls: object) -> list[dict[str, Any]]:
    """Tool calls with their `function.arguments` as JSON values, not JSON strings (vLLM's rule for tool-use
    templates: a missing or empty string is `{}`)."""
    if not isinstance(tool_calls, list | tuple) or not all(
        isinstance(call, Mapping) for call in tool_calls
    ):
        raise ChatInputError(
            "messages",
            f"{where}: tool_calls must be a list of tool calls such as {{'id': ..., 'type': 'function', 'function': "
            "{'name': ..., 'arguments': '{...}'}}",
        )
    normalized = []
    for index, call in enumerate(tool_calls):
        call = dict(call)
        function = call.get("function")
        if isinstance(function, Mapping):
            call["function"] = {
                **function,
                "arguments": _tool_arguments(
                    f"{where}: tool_calls[{index}].function.arguments", function.get("arguments")
                ),
            }
        normalized.append(call)
    return normalized


def _tool_arguments(where: str, arguments: object) -> Any:
    if not arguments:
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as error:
        raise ChatInputError("messages", f"{where} is not valid JSON: {error}") from error
