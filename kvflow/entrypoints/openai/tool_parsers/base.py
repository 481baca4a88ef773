"""What every tool-call parser shares: the parsed shapes, the parser base class and the one streaming scan.

A model output is read as a sequence of *content* (plain text for the client) and *call blocks* (the format's markup
and the calls' JSON). A format says three things (the hooks of `ToolParser`): where the next block starts
(`find_block_start`), where a started block ends (`find_block_end`; formats whose calls run to the end of the output
never end one) and what calls a block holds (`parse_block`; None makes the block content, verbatim). `ToolCallStream`
scans an output with these hooks as it arrives, and `extract_tool_calls` is the same scan over a whole output, so a
stream and the whole-output view agree by construction, for every way the output is split into pieces.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvflow.tokenizer import Tokenizer

WHITESPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `id` is unique per call ("chatcmpl-tool-<32 hex>", or the format's own form); `arguments` is
    a JSON object as text, exactly `json.dumps(parsed_arguments, ensure_ascii=False)`."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole output's calls, in output order, and its content: the text outside the calls, verbatim, or None when
    there are calls and that text is empty or only whitespace. With no calls, content is the whole output."""

    tool_calls: list[ToolCall]
    content: str | None


@dataclass(frozen=True)
class ToolCallDelta:
    """One fragment of one call in a stream. `index` is the call's position among the output's calls; a call's
    first fragment, and only it, carries `id` and `name`; its `arguments` pieces concatenate to the call's
    arguments text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StreamDelta:
    """What one push (or the finish) of a stream releases: content outside calls ("" if none) and call fragments."""

    content: str
    tool_calls: list[ToolCallDelta]


@dataclass(frozen=True)
class BlockStart:
    """Where a call block starts in a piece of text not yet released (`start`, None when none starts in it), and,
    when none starts, how much of its beginning is content whatever follows (`content_end`): the rest may still turn
    out to begin a block (a partial marker), so it is held back."""

    start: int | None
    content_end: int = 0


@dataclass(frozen=True)
class ParsedCall:
    """A call as a block holds it: the function's name and its arguments as JSON object text."""

    name: str
    arguments: str


class ToolParser(ABC):
    """Reads tool calls out of a model's output in one format. Stateless: one instance serves every request; each
    streamed choice gets its own `stream()`.

    Streaming invariant: for any split of an output into consecutive pieces, pushing them in order into a fresh
    stream and then finishing releases (a) content pieces whose concatenation is `extract_tool_calls(output).content
    or ""` and (b) call fragments that, grouped by index, give exactly the calls of `extract_tool_calls(output)` (same
    names and arguments, same order), each call's first fragment carrying its id and name. A call's markup and JSON
    never appear in content; a block that does not parse is content, verbatim, in both views.

    Subclasses implement the format hooks below; their answers may depend only on the text they are given, and
    `find_block_start` must be stable under extension: once it finds a block start or releases content for some
    text, it says the same for that text followed by anything.
    """

    name: ClassVar[str]
    # True where the format's markers are special tokens: the server then detokenizes with skip_special_tokens=False.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls and content of a whole output (the stream's scan, run over it at once)."""
        stream = self.stream()
        deltas = [stream.push(text), stream.finish()]
        calls = [
            ToolCall(id=call.id or "", name=call.name or "", arguments=call.arguments)
            for delta in deltas
            for call in delta.tool_calls
        ]
        content = "".join(delta.content for delta in deltas)
        if calls and not content.strip():
            return ExtractedToolCalls(tool_calls=calls, content=None)
        return ExtractedToolCalls(tool_calls=calls, content=content)

    def stream(self) -> ToolCallStream:
        """A fresh streaming state for one output."""
        return ToolCallStream(self)

    def new_call_id(self) -> str:
        """A fresh call id, vLLM's form: "chatcmpl-tool-" and 32 hex digits."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    # The format hooks.

    @abstractmethod
    def find_block_start(self, text: str, at_output_start: bool) -> BlockStart:
        """Where the next call block starts in `text`, unreleased text outside blocks; `at_output_start` is True when
        `text` begins at the output's first character."""

    def find_block_end(self, block: str) -> int | None:
        """The length of the block that `block` (text from a block's start) begins with, once it is closed; None
        while it is open. The default: blocks run to the end of the output."""
        return None

    @abstractmethod
    def parse_block(self, block: str) -> list[ParsedCall] | None:
        """The calls of one block (closed, or cut by the end of the output), at least one; None when the block is
        not a well-formed call block (it is then content, verbatim)."""


@dataclass
class ContentGate:
    """Holds content back while all of it so far is whitespace: an output whose content is only whitespace and that
    has calls reports no content (None), so that whitespace is released only at the finish, and only if no call was
    found. Once any other character arrives, all content so far and all later content passes straight through."""

    held: str = ""
    passing: bool = False

    def take(self, content: str) -> str:
        """The part of all content so far that may be released now, not yet released."""
        if self.passing:
            return content
        self.held += content
        if not self.held.strip():
            return ""
        self.passing = True
        released, self.held = self.held, ""
        return released

    def finish(self, found_calls: bool) -> str:
        """The held whitespace, released only when the output had no calls."""
        released, self.held = self.held, ""
        return "" if found_calls else released


@dataclass
class ToolCallStream:
    """One output's streaming state: the scan of `ToolParser`'s hooks over text as it arrives.

    Invariants: `pending` is the text not yet released, either outside blocks (a possible block start held back) or,
    with `in_block`, the text of the open block from its start; every character pushed before `pending` has been
    released as content (through `gate`) or consumed by a block; `num_calls` calls have been emitted, with indices
    0..num_calls-1. After `finish`, pushing is an error.
    """

    parser: ToolParser
    pending: str = ""
    in_block: bool = False
    at_output_start: bool = True
    num_calls: int = 0
    finished: bool = False
    gate: ContentGate = field(default_factory=ContentGate)

    def push(self, delta_text: str) -> StreamDelta:
        """Scan the newest text of the output; release what is decided."""
        if self.finished:
            raise RuntimeError("push after finish")
        self.pending += delta_text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._advance(content, calls):
            pass
        return StreamDelta(content=self.gate.take("".join(content)), tool_calls=calls)

    def finish(self) -> StreamDelta:
        """The output ended: an open block is parsed as it stands, held text outside blocks is content."""
        if self.finished:
            raise RuntimeError("finish called twice")
        self.finished = True
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self.in_block:
            self._close_block(self.pending, content, calls)
        else:
            content.append(self.pending)
        self.pending = ""
        released = self.gate.take("".join(content)) + self.gate.finish(self.num_calls > 0)
        return StreamDelta(content=released, tool_calls=calls)

    def _advance(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """One step of the scan over `pending`; False when nothing more is decided until more text arrives."""
        if self.in_block:
            end = self.parser.find_block_end(self.pending)
            if end is None:
                return False
            block, self.pending = self.pending[:end], self.pending[end:]
            self._close_block(block, content, calls)
            return True
        found = self.parser.find_block_start(self.pending, self.at_output_start)
        released = found.content_end if found.start is None else found.start
        if released:
            content.append(self.pending[:released])
            self.pending = self.pending[released:]
            self.at_output_start = False
        if found.start is None:
            return False
        self.in_block = True
        return True

    def _close_block(self, block: str, content: list[str], calls: list[ToolCallDelta]) -> None:
        """Emit a finished block's calls, or the block as content when it does not parse."""
        self.in_block = False
        self.at_output_start = False
        parsed = self.parser.parse_block(block)
        if parsed is None:
            content.append(block)
            return
        for call in parsed:
            call_id = self.parser.new_call_id()
            calls.append(ToolCallDelta(self.num_calls, call_id, call.name, call.arguments))
            self.num_calls += 1


# Helpers the formats share.


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json accepts NaN and Infinity; arguments must be JSON, so they are refused.
JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def load_json(text: str) -> Any:
    """`text` (surrounding whitespace allowed) as strict JSON; ValueError when it is not (or nests too deep)."""
    try:
        return JSON_DECODER.decode(text)
    except RecursionError as exc:
        raise ValueError("JSON nested too deep") from exc


def decode_json_prefix(text: str, position: int) -> tuple[Any, int]:
    """The JSON value starting at `position` (after optional whitespace) and the index after it; ValueError when
    none starts there."""
    position = WHITESPACE.match(text, position).end()
    try:
        return JSON_DECODER.raw_decode(text, position)
    except RecursionError as exc:
        raise ValueError("JSON nested too deep") from exc


def arguments_json(value: Any) -> str | None:
    """Arguments as JSON object text, from an object or from a JSON string holding one; None for anything else."""
    if isinstance(value, str):
        try:
            value = load_json(value)
        except ValueError:
            return None
    if not isinstance(value, Mapping):
        return None
    return json.dumps(value, ensure_ascii=False)


def find_marker(text: str, marker: str) -> BlockStart:
    """A block that starts at `marker`: its first occurrence in `text`, or, when there is none, everything but the
    longest end of `text` that `marker` starts with (it may yet become the marker) is content."""
    start = text.find(marker)
    if start >= 0:
        return BlockStart(start)
    for held in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-held:]):
            return BlockStart(None, len(text) - held)
    return BlockStart(None, len(text))
