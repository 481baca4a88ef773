"""OutputStream: the channel from whichever thread produces a request's outputs to the coroutine consuming them."""

from __future__ import annotations

import asyncio

from kvflow.outputs import RequestOutput


class OutputStream:
    """Carries `RequestOutput`s, or the exception that ends them, to one `generate` call's event loop.

    Invariants: any thread may `put`; only the consumer's event loop reads `queue`; `closed` turns True (once,
    never back) when the consumer has gone, after which nothing it would read matters.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand `item` to the consumer's loop; False when that loop is closed (the consumer is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True
