"""An assistant reply's text split into reasoning, content and tool calls, whole or as it streams.

The reasoning parser (`--reasoning-parser`) runs first: the text inside the reasoning markers is `reasoning`; what
follows goes on to the tool-call parser of the request's tool choice (`tool_calls.ToolChoice.reply_parser`), which
takes the calls out and leaves `content`. Either stage may be absent.

Invariant: for any split of a reply into consecutive pieces, `ReplyStream`'s deltas assemble into what
`ReplyParser.parse` gives for the whole text: the reasoning pieces join to `reasoning`, the content pieces to
`content`, and the call pieces (grouped by index; id and name on each call's first piece, arguments concatenated)
to `tool_calls`. With `parallel_tool_calls` false only the first call is kept, on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.entrypoints.openai.protocol import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvflow.entrypoints.openai.tool_parsers import StreamDelta

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.tool_calls import CallParser
    from kvflow.entrypoints.openai.tool_parsers import ToolCallDelta
    from kvflow.reasoning import ReasoningParser


@dataclass
class ReplyDelta:
    """What one push of a stream releases."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def merge(self, other: ReplyDelta) -> ReplyDelta:
        return ReplyDelta(
            self.reasoning + other.reasoning,
            self.content + other.content,
            [*self.tool_calls, *other.tool_calls],
        )

    def message(self, include_reasoning: bool) -> DeltaMessage:
        """The chunk's delta, with only the fields that hold something set (an empty delta has content "")."""
        delta = DeltaMessage()
        if self.reasoning and include_reasoning:
            delta.reasoning = delta.reasoning_content = self.reasoning
        if self.content:
            delta.content = self.content
        if self.tool_calls:
            delta.tool_calls = [_delta_tool_call(call) for call in self.tool_calls]
        if not delta.model_fields_set:
            delta.content = ""
        return delta


class ReplyParser:
    """One request's reply parsing: `reasoning` and `starts_in_reasoning` (the parser's verdict on the prompt),
    `tools` (None: no tool calls are parsed), `parallel` (`parallel_tool_calls`), `include_reasoning`,
    `forced_call` (the tool choice that forces a call, as named in `unmet_tool_choice`'s text; None if none)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        starts_in_reasoning: bool,
        tools: CallParser | None,
        parallel: bool = True,
        include_reasoning: bool = True,
        forced_call: str | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.starts_in_reasoning = starts_in_reasoning
        self.tools = tools
        self.parallel = parallel
        self.include_reasoning = include_reasoning
        self.forced_call = forced_call

    def unmet_tool_choice(self, text: str, made_calls: bool, finish: str | None) -> str | None:
        """Why a reply under a forced tool choice (`forced_call`) that ended (`finish`) made no call; None when
        it made one, is not forced, or has not ended. `text` is the whole reply (the stream asks its
        `ReplyStream.unmet_tool_choice`, which agrees)."""
        if self.forced_call is None or made_calls or finish is None:
            return None
        ended_in_reasoning = False
        if self.reasoning is not None:
            stream = self.reasoning.stream(self.starts_in_reasoning)
            stream.push(text)
            stream.finish()
            ended_in_reasoning = stream.in_reasoning
        return unmet_tool_choice_text(self, finish, ended_in_reasoning)

    @property
    def is_plain(self) -> bool:
        """Nothing to parse: the reply is all content."""
        return self.reasoning is None and self.tools is None

    def parse(self, text: str, echo: str = "") -> ChatMessage:
        """The whole reply as the response's message (`echo`: text that precedes the content)."""
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.extract_reasoning(text, self.starts_in_reasoning)
            reasoning, content = split.reasoning, split.content or ""
        calls: list[ToolCall] = []
        if self.tools is not None:
            extracted = self.tools.extract_tool_calls(content)
            content = extracted.content or ""
            kept = extracted.tool_calls if self.parallel else extracted.tool_calls[:1]
            calls = [
                ToolCall(
                    id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)
                )
                for call in kept
            ]
        if not self.include_reasoning:
            reasoning = None
        message_content = echo + content
        return ChatMessage(
            role="assistant",
            content=message_content if message_content or not (calls or reasoning) else None,
            reasoning=reasoning,
            reasoning_content=reasoning,
            tool_calls=calls,
        )

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


class ReplyStream:
    """One choice's streaming state. Invariant: see the module docstring; `made_calls` says whether any call
    piece has been released."""

    def __init__(self, parser: ReplyParser) -> None:
        self.parser = parser
        self.reasoning = (
            parser.reasoning.stream(parser.starts_in_reasoning)
            if parser.reasoning is not None
            else None
        )
        self.tools = parser.tools.stream() if parser.tools is not None else None
        self.made_calls = False

    def unmet_tool_choice(self, finish: str | None) -> str | None:
        """`ReplyParser.unmet_tool_choice` of the reply pushed so far (`finish` not None: after `finish()`)."""
        if self.parser.forced_call is None or self.made_calls or finish is None:
            return None
        ended_in_reasoning = self.reasoning is not None and self.reasoning.in_reasoning
        return unmet_tool_choice_text(self.parser, finish, ended_in_reasoning)

    def push(self, text: str) -> ReplyDelta:
        if self.reasoning is None:
            return self._tools(text, None)
        reasoning, content = self.reasoning.push(text)
        return ReplyDelta(reasoning=reasoning).merge(self._tools(content, None))

    def finish(self) -> ReplyDelta:
        """The reply ended: what the parsers held back."""
        delta = ReplyDelta()
        content = ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            delta.reasoning = reasoning
        return delta.merge(self._tools(content, True))

    def _tools(self, content: str, finishing: bool | None) -> ReplyDelta:
        if self.tools is None:
            return ReplyDelta(content=content)
        released = self.tools.push(content) if content else StreamDelta("", [])
        if finishing:
            final = self.tools.finish()
            released_calls = [*released.tool_calls, *final.tool_calls]
            text = released.content + final.content
        else:
            released_calls, text = list(released.tool_calls), released.content
        if not self.parser.parallel:
            released_calls = [call for call in released_calls if call.index == 0]
        self.made_calls = self.made_calls or bool(released_calls)
        return ReplyDelta(content=text, tool_calls=released_calls)


def unmet_tool_choice_text(parser: ReplyParser, finish: str, ended_in_reasoning: bool) -> str:
    """The explanation a choice carries (`unmet_tool_choice`) when its forced call was never made."""
    why = "ran out of max_tokens" if finish == "length" else f"stopped ({finish})"
    if ended_in_reasoning:
        assert parser.reasoning is not None
        end = parser.reasoning.end_marker
        return (
            f"tool_choice {parser.forced_call} forces a call after the reasoning, and the reply {why} inside "
            f"its reasoning, before {end}: no call was made (the thought is the reasoning; raise max_tokens, "
            "or end the thought sooner)"
        )
    return (
        f"tool_choice {parser.forced_call}: the reply {why} before a call was complete; no call was made "
        "(what was generated is the content)"
    )


def finish_reason(finish: str | None, made_calls: bool) -> str | None:
    """vLLM's finish_reason for a reply: "tool_calls" when it made calls and ended by itself (not by length)."""
    return "tool_calls" if made_calls and finish == "stop" else finish


def _delta_tool_call(call: ToolCallDelta) -> DeltaToolCall:
    if call.id is not None:
        return DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
    return DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))
