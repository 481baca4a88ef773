"""What the AsyncLLM end-to-end tests (tests/engine/test_async_llm*.py) share, their fixtures aside (conftest.py):
the engines' options, streaming helpers, the hash model's reference tokens, and the session helpers
(`ChunkFeed`, `session_reference`, `read_chunk`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from kvflow import RequestOutput, SamplingParams, StreamingInput
from kvflow.engine.async_llm import AsyncLLM
from kvflow.engine.core import EngineCore
from kvflow.engine.mp_client import MPEngineCoreClient
from kvflow.testing.hash_model import reference_tokens

T = TypeVar("T")
TIMEOUT_S = 20.0
LONG = 400  # max_tokens of a request that is still running when the test acts on it


# ------------------------------------------------------------------------------------------------ helpers
ENGINE_OPTIONS: dict[str, Any] = dict(
    max_num_seqs=8, num_kv_blocks=320, block_size=4, max_model_len=1024, max_num_batched_tokens=64
)


async def is_idle(llm: AsyncLLM) -> bool:
    """Alive, not paused, and holding no request, block or slot: fit for the next test."""
    if llm.engine_core_client.dead_error is not None or await llm.is_paused():
        return False
    try:
        await wait_until_clean(llm)
    except AssertionError:
        return False
    return True


def uses_engine_process(llm: AsyncLLM) -> bool:
    return isinstance(llm.engine_core_client, MPEngineCoreClient)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a test coroutine on a fresh event loop; a hang fails the test instead of freezing the suite."""
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def prompt(seed: int, length: int = 6) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(seed * 37 + j * 11) % 991 + 1 for j in range(length)]}


def reference(prompt_dict: dict[str, list[int]], max_tokens: int) -> list[int]:
    return reference_tokens(prompt_dict["prompt_token_ids"], max_tokens)


def params(max_tokens: int, output_kind: str = "cumulative", **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, output_kind=output_kind, **kwargs)  # type: ignore[arg-type]


async def collect(
    llm: AsyncLLM,
    prompt_: Any,
    sampling_params: SamplingParams | None = None,
    request_id: str | None = None,
) -> list[RequestOutput]:
    return [output async for output in llm.generate(prompt_, sampling_params, request_id)]


def tokens_of(outputs: list[RequestOutput], output_kind: str = "cumulative") -> list[int]:
    if output_kind == "delta":
        return [token for output in outputs for token in output.outputs[0].token_ids]
    return list(outputs[-1].outputs[0].token_ids)


def engine_snapshot(core: EngineCore) -> dict[str, Any]:
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    return dict(
        requests=sorted(scheduler.requests),
        usage=scheduler.kv_cache_manager.usage,
        free_blocks=pool.get_num_free_blocks(),
        num_blocks=pool.num_blocks,
        slot_holders=scheduler.num_slot_holders,
        pending_reports=scheduler.has_pending_reports(),
        free_slots=core.executor.worker.model_runner.slots.num_free,
        max_num_seqs=scheduler.max_num_running_reqs,
    )


async def wait_until_clean(llm: AsyncLLM) -> dict[str, Any]:
    """Wait until the engine holds no request, no KV block and no worker slot (aborts land asynchronously)."""
    snapshot: dict[str, Any] = {}
    for _ in range(300):
        snapshot = await llm.run_in_engine(engine_snapshot)
        if (
            not snapshot["requests"]
            and snapshot["usage"] == 0
            and snapshot["free_blocks"] == snapshot["num_blocks"]
            and snapshot["slot_holders"] == 0
            and not snapshot["pending_reports"]
            and snapshot["free_slots"] == snapshot["max_num_seqs"]
        ):
            return snapshot
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine never became clean: {snapshot}")


async def next_output(iterator: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await iterator.__anext__()


class ChunkFeed:
    """A streaming-input iterator driven by the test: `send` a chunk, `end` the input, or `fail` with an error."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[StreamingInput | BaseException | None] = asyncio.Queue()
        self.closed = False

    def send(self, token_ids: list[int], sampling_params: SamplingParams | None = None) -> None:
        self.queue.put_nowait(StreamingInput({"prompt_token_ids": token_ids}, sampling_params))

    def end(self) -> None:
        self.queue.put_nowait(None)

    def fail(self, error: BaseException) -> None:
        self.queue.put_nowait(error)

    async def items(self) -> AsyncIterator[StreamingInput]:
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


def session_reference(chunks: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each chunk's expected tokens: the session's prompt for chunk k is everything before (prompts and outputs,
    minus each chunk's last sampled token, never fed to the model) plus the chunk."""
    history: list[int] = []
    expected = []
    for chunk, max_tokens in chunks:
        history = history + chunk
        expected.append(reference_tokens(history, max_tokens))
        history = history + expected[-1][:-1]
    return expected


async def read_chunk(iterator: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """Outputs up to and including the one that ends the current chunk (finish_reason set)."""
    outputs = [await next_output(iterator)]
    while outputs[-1].outputs[0].finish_reason is None:
        outputs.append(await next_output(iterator))
    return outputs
