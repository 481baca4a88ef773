"""The responses a server keeps for `GET /v1/responses/{id}` and `previous_response_id`: in memory, at most a bounded
number (`--max-stored-responses`), the least recently used one evicted first.

A stored response is its answer (the `Response` object as sent, updated as a background response runs) and the
conversation it ended: the messages of its input (after its `previous_response_id`'s, instructions excepted, as
OpenAI does not carry instructions over) followed by its output as chat messages, ready to prepend to a follow-up.
Nothing is written to disk: a restart forgets every response.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from kvflow.entrypoints.openai.errors import OpenAIServingError

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    """One kept response. `body` is the `Response` object clients read (its `status` moves from "queued" or
    "in_progress" to a final one exactly once); `messages` is the conversation up to and including its output (set
    once it has finished; empty before); `input_items` are its request's input as items with ids (GET
    /v1/responses/{id}/input_items); `task` runs a background response (None otherwise)."""

    body: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    input_items: list[dict[str, Any]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.body.get("status") in ("queued", "in_progress")


class ResponseStore:
    """The responses of one server, by id.

    Invariants: holds at most `max_responses` entries; a `get`, `put` or `update` makes its entry the most
    recently used; when full, `put` evicts the least recently used entry that is not running (a background response
    is never evicted while it runs; when every entry runs the store grows past the bound until one ends). Used from
    the event loop only.
    """

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._responses

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        self._evict()

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 in OpenAI's shape naming the id (and `param`, the field that sent it) when
        it was never stored, was deleted, or has been evicted."""
        stored = self._responses.get(response_id)
        if stored is None:
            raise OpenAIServingError(
                f"Response with id {response_id!r} not found: it was never stored (store: false), was deleted, "
                f"or is past the {self.max_responses} most recent responses this server keeps "
                "(--max-stored-responses)",
                status_code=HTTPStatus.NOT_FOUND,
                param=param,
            )
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> StoredResponse:
        stored = self.get(response_id)
        del self._responses[response_id]
        return stored

    def _evict(self) -> None:
        excess = len(self._responses) - self.max_responses
        if excess <= 0:
            return
        evicted = []
        for response_id, stored in self._responses.items():  # least recently used first
            if len(evicted) == excess:
                break
            if not stored.running:
                evicted.append(response_id)
        for response_id in evicted:
            del self._responses[response_id]
