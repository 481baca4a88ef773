"""OutputStream: the channel from whichever thread produces a request's outputs to the coroutine consuming them.

A stream holds at most what its consumer has not taken yet, coalesced: when the consumer falls behind, a new "delta"
output is appended to the one still waiting (its text, token ids and logprobs extended) and a new cumulative one
replaces it, so a slow consumer wakes once for everything that arrived meanwhile, not once per engine step.
Producers put outputs without waking anyone and hand the wake-ups to `Wakeups`, which wakes every stream of one
engine step with one call per event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

from kvflow.outputs import CompletionOutput, RequestOutput

_Item = RequestOutput | BaseException


class OutputStream:
    """Carries `RequestOutput`s, or the exception that ends them, to one `generate` call's event loop.

    Invariants:
      * any thread may put; only the consumer's event loop calls `get`;
      * outputs come out in the order they were put, an exception after every output put before it;
      * an output is merged only into the newest waiting output, and only while that one is unfinished and none
        of its completions has a finish reason (a streaming-input chunk's end stays its own output): "delta"
        outputs (`delta` True) concatenate per completion index, others replace it. Concatenated deltas equal the
        deltas one by one, so a consumer sees the same tokens and text however far behind it is;
      * `closed` turns True (once, never back) when the consumer has gone, after which nothing matters.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool = False) -> None:
        self.loop = loop
        self.delta = delta  # how to merge outputs: concatenate ("delta" output kind) or replace
        self.closed = False
        self._lock = threading.Lock()
        self._items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------------------------------------ producers
    def put(self, item: _Item) -> bool:
        """Hand `item` to the consumer and wake it now; False when its loop is closed (the consumer is gone)."""
        wakeups = Wakeups()
        if not self.put_deferred(item, wakeups):
            return False
        return not wakeups.flush()

    def put_deferred(self, item: _Item, wakeups: Wakeups) -> bool:
        """Hand `item` to the consumer; a consumer waiting for it is woken by `wakeups.flush()`. False when its
        loop is closed (the consumer is gone)."""
        if self.loop.is_closed():
            return False
        with self._lock:
            items = self._items
            if (
                items
                and isinstance(item, RequestOutput)
                and isinstance(items[-1], RequestOutput)
                and _mergeable(items[-1])
            ):
                items[-1] = merge_outputs(items[-1], item, self.delta)
            else:
                items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            wakeups.add(self.loop, waiter)
        return True

    # ------------------------------------------------------------------------------------------------ consumer
    async def get(self) -> _Item:
        """The next item: an output (everything that arrived since the last one, merged), or the exception that
        ended the stream once the outputs before it were taken."""
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                waiter = self._waiter = self.loop.create_future()
            await waiter


class Wakeups:
    """The consumers to wake after a batch of `put_deferred`s: `flush()` wakes them with one
    `call_soon_threadsafe` per event loop (none for a loop it runs on: it wakes those directly)."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None]) -> None:
        waiters = self._by_loop.get(loop)
        if waiters is None:
            self._by_loop[loop] = [waiter]
        else:
            waiters.append(waiter)

    def flush(self) -> list[asyncio.AbstractEventLoop]:
        """Wake every consumer added; returns the loops that are closed (their consumers are gone)."""
        by_loop, self._by_loop = self._by_loop, {}
        closed = []
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, waiters in by_loop.items():
            if loop is running:
                _wake(waiters)
                continue
            try:
                loop.call_soon_threadsafe(_wake, waiters)
            except RuntimeError:  # the loop is closed
                closed.append(loop)
        return closed


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():  # a consumer cancelled meanwhile has cancelled its waiter
            waiter.set_result(None)


def _mergeable(output: RequestOutput) -> bool:
    if output.finished:
        return False
    return all(completion.finish_reason is None for completion in output.outputs)


def merge_outputs(older: RequestOutput, newer: RequestOutput, delta: bool) -> RequestOutput:
    """What a consumer that missed `older` should see instead of both: `newer` (cumulative outputs), or (delta)
    each completion's text, token ids and logprobs concatenated, per completion index. Builds new objects: the
    outputs it was given may be held elsewhere (a session keeps its chunk's last output)."""
    if not delta:
        return newer
    completions = list(older.outputs)
    position = {completion.index: i for i, completion in enumerate(completions)}
    for completion in newer.outputs:
        i = position.get(completion.index)
        if i is None:
            position[completion.index] = len(completions)
            completions.append(completion)
        else:
            completions[i] = _concatenate(completions[i], completion)
    return RequestOutput(
        request_id=newer.request_id,
        prompt=newer.prompt,
        prompt_token_ids=newer.prompt_token_ids,
        outputs=completions,
        finished=newer.finished,
        metrics=newer.metrics,
        prompt_logprobs=older.prompt_logprobs
        if older.prompt_logprobs is not None
        else newer.prompt_logprobs,
        lora_request=newer.lora_request,
    )


def _concatenate(older: CompletionOutput, newer: CompletionOutput) -> CompletionOutput:
    if older.logprobs is None:
        logprobs = newer.logprobs
    elif newer.logprobs is None:
        logprobs = older.logprobs
    else:
        logprobs = older.logprobs + newer.logprobs
    return CompletionOutput(
        index=newer.index,
        text=older.text + newer.text,
        token_ids=older.token_ids + newer.token_ids,
        finish_reason=newer.finish_reason,
        stop_reason=newer.stop_reason,
        logprobs=logprobs,
        cumulative_logprob=newer.cumulative_logprob,
        weight_versions=newer.weight_versions,
        client_error=newer.client_error,
    )
