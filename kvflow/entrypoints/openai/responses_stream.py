"""The typed server-sent events of a streamed /v1/responses reply, in OpenAI's order and shapes.

    response.created, response.in_progress                    the response, status "in_progress", no output yet
    per output item, in output order:
      response.output_item.added                              the item, status "in_progress"
      reasoning:  response.content_part.added (reasoning_text), response.reasoning_text.delta ...,
                  response.reasoning_text.done, response.content_part.done
      message:    response.content_part.added (output_text), response.output_text.delta ...,
                  response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ..., response.function_call_arguments.done
      response.output_item.done                               the item, whole
    response.completed | response.incomplete | response.failed  the whole response (cancelled: response.incomplete)

Each event is `event: <type>` and `data: <json>` with the event's `type` and a `sequence_number` that counts up from
0. The reply's pieces come from `chat_reply.ReplyStream` (the same parsing as a whole reply), so the items a stream
closes hold what `responses_items.output_items` makes of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvflow.entrypoints.openai.responses_items import (
    function_call_item,
    item_id,
    message_item,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
)

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.chat_reply import ReplyDelta

REASONING, MESSAGE, FUNCTION_CALL = "reasoning", "message", "function_call"
# The event that ends a stream, by the response's final status.
FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


@dataclass
class _OpenItem:
    """The output item being streamed: its kind, its in-progress item (as `output_item.added` sent it), its index
    in the output, the text (or arguments) so far, and for a call, its index among the reply's calls."""

    kind: str
    item: dict[str, Any]
    output_index: int
    text: str = ""
    call_index: int | None = None


class ResponseEvents:
    """The events of one streamed response.

    Invariants: `sequence_number` is the number of events made so far; at most one item is open, and an item is
    opened only after the one before it was closed (its `.done` events sent); `items` holds the closed items in
    output order, so `items` plus the open one are the response's output so far.
    """

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None

    def event(self, event_type: str, **fields: Any) -> bytes:
        payload = {"type": event_type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return (
            b"event: " + event_type.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"
        )

    def start(self, response: dict[str, Any]) -> list[bytes]:
        """response.created and response.in_progress for the in-progress `response`."""
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def push(self, delta: ReplyDelta) -> list[bytes]:
        """The events of one piece of the reply (its reasoning, then its text, then its calls' pieces)."""
        events: list[bytes] = []
        if delta.reasoning:
            events += self._ensure_open(REASONING)
            events += self._text_delta("response.reasoning_text.delta", delta.reasoning)
        if delta.content:
            events += self._ensure_open(MESSAGE)
            events += self._text_delta("response.output_text.delta", delta.content, logprobs=[])
        for call in delta.tool_calls:
            if call.id is not None:
                events += self._close("completed")
                item = function_call_item(
                    item_id("fc"), call.id, call.name or "", "", "in_progress"
                )
                events += self._open(_OpenItem(FUNCTION_CALL, item, len(self.items)), call.index)
            open_item = self.open
            if call.arguments and open_item is not None and open_item.call_index == call.index:
                open_item.text += call.arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=open_item.item["id"],
                        output_index=open_item.output_index,
                        delta=call.arguments,
                    )
                )
        return events

    def finish(self, response: dict[str, Any]) -> list[bytes]:
        """Close the open item and end the stream with `response` (final status, no output yet: it gets the
        items). A reply that streamed nothing gets one empty message, as a whole reply does."""
        item_status = "completed" if response["status"] == "completed" else "incomplete"
        events = self._close(item_status)
        if not self.items and response["status"] in ("completed", "incomplete"):
            events += self._ensure_open(MESSAGE) + self._close(item_status)
        response["output"] = self.items
        events.append(self.event(FINAL_EVENTS[response["status"]], response=response))
        return events

    # ------------------------------------------------------------------------------------------------ items
    def _ensure_open(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open.kind == kind:
            return []
        events = self._close("completed")
        if kind == REASONING:
            item = reasoning_item(item_id("rs"), None, "in_progress")
        else:
            item = message_item(item_id("msg"), None, "in_progress")
        return events + self._open(_OpenItem(kind, item, len(self.items)))

    def _open(self, open_item: _OpenItem, call_index: int | None = None) -> list[bytes]:
        open_item.call_index = call_index
        self.open = open_item
        where = {"output_index": open_item.output_index}
        events = [self.event("response.output_item.added", **where, item=open_item.item)]
        if open_item.kind != FUNCTION_CALL:
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=open_item.item["id"],
                    **where,
                    content_index=0,
                    part=self._part(open_item.kind, ""),
                )
            )
        return events

    def _text_delta(self, event_type: str, text: str, **fields: Any) -> list[bytes]:
        open_item = self.open
        assert open_item is not None
        open_item.text += text
        return [
            self.event(
                event_type,
                item_id=open_item.item["id"],
                output_index=open_item.output_index,
                content_index=0,
                delta=text,
                **fields,
            )
        ]

    def _close(self, status: str) -> list[bytes]:
        """The `.done` events of the open item (if any), which becomes `status` and joins `items`."""
        open_item, self.open = self.open, None
        if open_item is None:
            return []
        identifier, text = open_item.item["id"], open_item.text
        where = {"item_id": identifier, "output_index": open_item.output_index}
        events = []
        if open_item.kind == FUNCTION_CALL:
            item = {**open_item.item, "arguments": text, "status": status}
            events.append(
                self.event("response.function_call_arguments.done", **where, arguments=text)
            )
        else:
            part = self._part(open_item.kind, text)
            if open_item.kind == REASONING:
                item = reasoning_item(identifier, text, status)
                events.append(
                    self.event("response.reasoning_text.done", **where, content_index=0, text=text)
                )
            else:
                item = message_item(identifier, text, status)
                events.append(
                    self.event(
                        "response.output_text.done",
                        **where,
                        content_index=0,
                        text=text,
                        logprobs=[],
                    )
                )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        events.append(
            self.event("response.output_item.done", output_index=open_item.output_index, item=item)
        )
        self.items.append(item)
        return events

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        return reasoning_text_part(text) if kind == REASONING else output_text_part(text)
