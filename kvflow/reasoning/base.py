"""What a reasoning parser is: where a model's reasoning (`<think> ... </think>`) ends and its answer begins.

A parser is pure text logic, shared by the API server (which splits `message.reasoning` from `message.content`) and
the engine core (which starts a structured-output constraint where the reasoning ends, see
`kvflow.structured_output.reasoning_end`). Both must agree on one rule, stated here once:

  * The output is in reasoning from its start if `starts_in_reasoning` (decided from the rendered prompt by
    `ReasoningParser.starts_in_reasoning`), or if it opens with the start marker (after optional whitespace),
    which is then dropped.
  * Reasoning runs to the first end marker; everything after it is content. Without an end marker (a thought cut
    short by max_tokens) the whole output is reasoning.
  * Otherwise the whole output is content.
  * Newlines are trimmed as Qwen3 and DeepSeek-R1 write them (`<think>\\n...\\n</think>\\n\\ncontent`): the
    reasoning loses its leading and trailing newlines, the content its leading ones. Empty pieces are None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    """One output split by a parser. `reasoning`: the text between the markers (None if the output has none, or
    an empty thought); `content`: the rest (None if empty). Neither holds the start marker that opened the
    reasoning nor the end marker that closed it; text after that end marker is content verbatim (but for its
    leading newlines), even if it spells a marker again."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """Splits model outputs into reasoning and content (stateless: one per server, shared by every request).

    Subclasses say only how the rendered prompt leaves the output (`starts_in_reasoning`); the split itself is
    the rule in the module docstring, so all parsers trim and hold back text the same way.

    Invariant: for any output and any split of it into consecutive pieces, the pieces `stream(s).push` returns,
    followed by `finish()`'s, concatenate to `extract_reasoning(output, s)` (the reasoning pieces to
    `split.reasoning or ""`, the content pieces to `split.content or ""`).
    """

    name: ClassVar[str]
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """Whether the output starts inside reasoning, given the rendered prompt (chat template applied)."""
        raise NotImplementedError

    def last_prompt_marker(self, prompt_text: str) -> str | None:
        """The marker that occurs last in `prompt_text` (`start_marker` or `end_marker`), or None if neither does.
        E.g. Qwen3's `enable_thinking=False` prompt ends `<think>\\n\\n</think>\\n\\n`: the end marker."""
        start_at = prompt_text.rfind(self.start_marker)
        end_at = prompt_text.rfind(self.end_marker)
        if start_at < 0 and end_at < 0:
            return None
        return self.start_marker if start_at > end_at else self.end_marker

    def extract_reasoning(self, text: str, starts_in_reasoning: bool) -> ReasoningSplit:
        """Split a whole output (see the module docstring for the rule)."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_marker):
            body = stripped[len(self.start_marker) :]
        elif starts_in_reasoning:
            body = text
        else:
            return ReasoningSplit(None, text.lstrip("\n") or None)
        reasoning, _, content = body.partition(self.end_marker)
        return ReasoningSplit(reasoning.strip("\n") or None, content.lstrip("\n") or None)

    def stream(self, starts_in_reasoning: bool) -> ReasoningStream:
        """A splitter for one output that arrives in pieces."""
        return ReasoningStream(self.start_marker, self.end_marker, starts_in_reasoning)


class ReasoningStream:
    """`extract_reasoning` applied to an output that arrives in pieces (one per request and output).

    `push(delta)` returns the (reasoning, content) text it can release now; `finish()` releases what was held back
    once the output has ended. Text is held back only while it could still change meaning: leading whitespace
    and a prefix of the start marker (is this a `<think>`?), a suffix that could begin the end marker, and
    newlines that would be trimmed if the reasoning ended right after them. Invariant: see `ReasoningParser`;
    the markers that open and close the reasoning never reach either piece. Nothing may be pushed after
    `finish()`.
    """

    def __init__(self, start_marker: str, end_marker: str, starts_in_reasoning: bool) -> None:
        self._start_marker = start_marker
        self._end_marker = end_marker
        self._starts_in_reasoning = starts_in_reasoning
        self._phase = "preamble"  # then "reasoning" and/or "content"
        self._held = ""  # received, not released: see the class docstring
        self._reasoning_started = (
            False  # some reasoning text was released (no more leading newlines)
        )
        self._content_started = False

    def push(self, delta_text: str) -> tuple[str, str]:
        """The (reasoning piece, content piece) released by `delta_text` (either may be empty)."""
        if self._phase == "preamble":
            self._held += delta_text
            stripped = self._held.lstrip()
            if len(stripped) < len(self._start_marker) and self._start_marker.startswith(stripped):
                return "", ""  # all whitespace so far, or a start marker's beginning
            return self._leave_preamble()
        if self._phase == "reasoning":
            return self._reasoning(delta_text)
        return "", self._content(delta_text)

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far is inside an open thought (after `finish()`: the output ended in one)."""
        return self._phase == "reasoning"

    def finish(self) -> tuple[str, str]:
        """The output ended: release what was held back."""
        reasoning, content = self._leave_preamble() if self._phase == "preamble" else ("", "")
        if self._phase == "reasoning":  # a thought cut short: it is all reasoning
            reasoning += self._release_reasoning(self._held)[0]
            self._held = ""
        return reasoning, content

    def _leave_preamble(self) -> tuple[str, str]:
        """Decide from the text so far (held whole) whether it opened with the start marker."""
        text, self._held = self._held, ""
        stripped = text.lstrip()
        if stripped.startswith(self._start_marker):
            self._phase = "reasoning"
            return self._reasoning(stripped[len(self._start_marker) :])
        if self._starts_in_reasoning:
            self._phase = "reasoning"
            return self._reasoning(text)
        self._phase = "content"
        return "", self._content(text)

    def _reasoning(self, text: str) -> tuple[str, str]:
        held = self._held + text
        end_at = held.find(self._end_marker)
        if end_at >= 0:
            self._held = ""
            reasoning, _ = self._release_reasoning(held[:end_at])
            self._phase = "content"
            return reasoning, self._content(held[end_at + len(self._end_marker) :])
        num_marker_chars = _partial_marker_length(held, self._end_marker)
        safe = held[: len(held) - num_marker_chars]
        released, num_newlines = self._release_reasoning(safe)
        # Held back: the trailing newlines of `safe` (kept only if more reasoning follows), then what may begin
        # the end marker.
        self._held = held[len(held) - num_marker_chars - num_newlines :]
        return released, ""

    def _release_reasoning(self, text: str) -> tuple[str, int]:
        """`text` without its trailing newlines, and without its leading ones before any reasoning was released;
        and the number of trailing newlines left out."""
        if not self._reasoning_started:
            text = text.lstrip("\n")
        released = text.rstrip("\n")
        if released:
            self._reasoning_started = True
        return released, len(text) - len(released)

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text


def _partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
