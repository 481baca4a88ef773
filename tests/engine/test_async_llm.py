"""AsyncLLM end to end: streaming kinds, concurrency, aborts and cancellation, pause / resume, streaming-input
sessions, engine errors and shutdown. The hash model is the oracle (exact tokens); the default model covers text."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from kvflow import RequestOutput, SamplingParams, StreamingInput
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.engine.core import EngineCore
from kvflow.engine.mp_client import MPEngineCoreClient
from kvflow.request import RequestStatus
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.streams import check_stream_shape, fold_outputs

T = TypeVar("T")
TIMEOUT_S = 20.0
LONG = 400  # max_tokens of a request that is still running when the test acts on it


# ------------------------------------------------------------------------------------------------ helpers
ENGINE_OPTIONS: dict[str, Any] = dict(
    max_num_seqs=8, num_kv_blocks=320, block_size=4, max_model_len=1024, max_num_batched_tokens=64
)


@pytest.fixture(scope="module")
def process_engines() -> Iterator[dict[tuple[Any, ...], AsyncLLM]]:
    """Engines with their core in its own process, shared by the tests of this module: one per set of options
    (a process takes a second or two to start). A test leaves its engine here only if it is still healthy and idle
    (see `make_llm`)."""
    engines: dict[tuple[Any, ...], AsyncLLM] = {}
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.fixture(params=[False, True], ids=["inproc", "proc"])
def make_llm(
    request: pytest.FixtureRequest, process_engines: dict[tuple[Any, ...], AsyncLLM]
) -> Iterator[Callable[..., AsyncLLM]]:
    """Engines on either client: the in-process one (a fresh engine per call) or the multiprocess one (an idle
    shared engine with the same options, else a new one)."""
    engine_process: bool = request.param
    engines: list[tuple[tuple[Any, ...], AsyncLLM]] = []

    def make(model: str | None = "hash", **overrides: Any) -> AsyncLLM:
        options = {**ENGINE_OPTIONS, **overrides}
        key = tuple(sorted(dataclasses.asdict(EngineArgs(model, **options)).items()))
        engine = process_engines.pop(key, None) if engine_process else None
        if engine is None or engine.engine_core_client.dead_error is not None:
            engine = AsyncLLM(model, engine_process=engine_process, **options)
        engines.append((key, engine))
        return engine

    yield make
    for key, engine in engines:
        if engine_process and key not in process_engines and run(is_idle(engine)):
            process_engines[key] = engine
        else:
            engine.shutdown()


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


# ------------------------------------------------------------------------------------------------ streaming
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_output_kinds_stream_the_reference_tokens(
    make_llm: Callable[..., AsyncLLM], async_scheduling: bool
) -> None:
    llm = make_llm(async_scheduling=async_scheduling)
    expected = reference(prompt(1), 6)

    async def main() -> None:
        # How many outputs a stream has depends on how far behind its consumer is (they coalesce); their shape
        # and what they add up to do not.
        cumulative = await collect(llm, prompt(1), params(6))
        check_stream_shape(cumulative, "cumulative")
        assert all(
            output.outputs[0].token_ids == expected[: len(output.outputs[0].token_ids)]
            for output in cumulative
        )
        assert cumulative[-1].outputs[0].token_ids == expected
        assert cumulative[-1].outputs[0].finish_reason == "length"
        assert cumulative[-1].prompt_token_ids == prompt(1)["prompt_token_ids"]
        delta = await collect(llm, prompt(1), params(6, "delta"))
        check_stream_shape(delta, "delta")
        assert fold_outputs(delta, "delta").outputs[0].token_ids == expected
        final_only = await collect(llm, prompt(1), params(6, "final_only"))
        assert len(final_only) == 1 and final_only[0].finished
        assert final_only[0].outputs[0].token_ids == expected
        assert (await collect(llm, prompt(1)))[-1].outputs[0].token_ids == reference(
            prompt(1), 16
        )  # defaults

    run(main())


def test_many_concurrent_generate_calls_all_get_their_reference(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm(max_num_seqs=4)
    cases = [
        (
            prompt(seed, 3 + seed % 9),
            2 + seed % 7,
            random.Random(seed).choice(["cumulative", "delta"]),
        )
        for seed in range(24)
    ]

    async def main() -> None:
        results = await asyncio.gather(
            *(
                collect(llm, p, params(n, kind), request_id=f"r{i}")
                for i, (p, n, kind) in enumerate(cases)
            )
        )
        for (p, n, kind), outputs in zip(cases, results, strict=True):
            assert tokens_of(outputs, kind) == reference(p, n)
            assert outputs[-1].finished and not any(output.finished for output in outputs[:-1])
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("output_kind", ["cumulative", "delta", "final_only"])
def test_n_samples_fold_into_one_stream(
    make_llm: Callable[..., AsyncLLM], output_kind: str
) -> None:
    llm = make_llm()
    expected = reference(prompt(3), 5)

    async def main() -> None:
        outputs = await collect(llm, prompt(3), params(5, output_kind, n=3), request_id="parallel")
        assert all(output.request_id == "parallel" for output in outputs)
        assert outputs[-1].finished and not any(output.finished for output in outputs[:-1])
        if output_kind == "delta":
            per_index: dict[int, list[int]] = {}
            for output in outputs:
                for completion in output.outputs:
                    per_index.setdefault(completion.index, []).extend(completion.token_ids)
            assert per_index == {0: expected, 1: expected, 2: expected}
        else:
            assert [c.index for c in outputs[-1].outputs] == [0, 1, 2]
            assert all(
                c.token_ids == expected and c.finish_reason == "length" for c in outputs[-1].outputs
            )
        if output_kind == "final_only":
            assert len(outputs) == 1
        await wait_until_clean(llm)

    run(main())


def test_bad_inputs_raise_value_error_before_anything_is_queued(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm(max_model_len=64, num_kv_blocks=32)

    async def main() -> None:
        bad_calls = [
            ({"prompt_token_ids": [1, -5]}, None, "prompt_token_ids"),
            ("text needs a tokenizer", None, "no tokenizer"),
            ({"prompt_token_ids": [3] * 64}, None, "max_model_len=64"),
            (prompt(1), "not params", "sampling_params"),
            (prompt(1), None, "request_id"),
        ]
        for index, (bad_prompt, bad_params, match) in enumerate(bad_calls):
            request_id = 42 if match == "request_id" else f"bad{index}"
            with pytest.raises(ValueError, match=match):
                await collect(llm, bad_prompt, bad_params, request_id=request_id)  # type: ignore[arg-type]
            snapshot = await llm.run_in_engine(engine_snapshot)
            assert snapshot["requests"] == [] and snapshot["free_blocks"] == snapshot["num_blocks"]
        assert tokens_of(await collect(llm, prompt(2), params(3), request_id="bad0")) == reference(
            prompt(2), 3
        )

    run(main())


def test_live_request_id_is_rejected_and_reusable_after_it_ends(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm()

    async def main() -> None:
        first = llm.generate(prompt(1), params(LONG, "delta"), request_id="same")
        await next_output(first)
        with pytest.raises(ValueError, match="already in use"):
            await collect(llm, prompt(2), params(3), request_id="same")
        await first.aclose()
        await wait_until_clean(llm)
        assert tokens_of(await collect(llm, prompt(2), params(3), request_id="same")) == reference(
            prompt(2), 3
        )

    run(main())


# ------------------------------------------------------------------------------------------------ abort, cancel
def test_abort_mid_stream_ends_with_partial_tokens(make_llm: Callable[..., AsyncLLM]) -> None:
    llm = make_llm()
    expected = reference(prompt(5), LONG)

    async def main() -> None:
        stream = llm.generate(prompt(5), params(LONG, "delta"), request_id="victim")
        received = [await next_output(stream) for _ in range(3)]
        await llm.abort("victim")
        received += [output async for output in stream]
        final = received[-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        assert not any(output.finished for output in received[:-1])
        tokens = tokens_of(received, "delta")
        assert 3 <= len(tokens) < LONG and tokens == expected[: len(tokens)]
        await llm.abort(["victim", "never-existed"])  # finished and unknown ids are ignored
        parallel = llm.generate(prompt(6), params(LONG, n=2), request_id="parallel")
        await next_output(parallel)
        await llm.abort("parallel")
        final = [output async for output in parallel][-1]
        assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "abort"]
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("how", ["cancel", "aclose", "break"])
def test_consumer_leaving_aborts_and_frees_blocks_and_slot(
    make_llm: Callable[..., AsyncLLM], how: str
) -> None:
    llm = make_llm()

    async def consume(seen: asyncio.Event, leave: asyncio.Event) -> None:
        async for _ in llm.generate(prompt(7), params(LONG), request_id="leaver"):
            seen.set()
            if how == "break":
                await leave.wait()
                break

    async def main() -> None:
        # Leave while a pause freezes the request: only the abort that leaving sends can free it.
        if how == "aclose":
            stream = llm.generate(prompt(7), params(LONG), request_id="leaver")
            await next_output(stream)
            await llm.pause_generation(mode="keep", clear_cache=False)
            await stream.aclose()
        else:
            seen, leave = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(consume(seen, leave))
            await seen.wait()
            await llm.pause_generation(mode="keep", clear_cache=False)
            if how == "cancel":
                task.cancel()  # it waits inside generate() for the next output
            leave.set()
            with (
                pytest.raises(asyncio.CancelledError)
                if how == "cancel"
                else contextlib.nullcontext()
            ):
                await task
        snapshot = await wait_until_clean(llm)
        assert snapshot["usage"] == 0 and await llm.is_paused()
        await llm.resume_generation()
        # the id is free again and the engine still serves exact tokens
        assert tokens_of(
            await collect(llm, prompt(7), params(4), request_id="leaver")
        ) == reference(prompt(7), 4)

    run(main())


# ------------------------------------------------------------------------------------------------ pause / resume
@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_keep_freezes_output_and_resume_finishes_exactly(
    make_llm: Callable[..., AsyncLLM], clear_cache: bool
) -> None:
    llm = make_llm()
    max_tokens = 200

    async def main() -> None:
        outputs: list[RequestOutput] = []
        started = asyncio.Event()

        async def consume() -> None:
            async for output in llm.generate(
                prompt(9), params(max_tokens, "delta"), request_id="frozen"
            ):
                outputs.append(output)
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        await llm.pause_generation(mode="keep", clear_cache=clear_cache)
        assert await llm.is_paused()
        await asyncio.sleep(0.05)  # let already-delivered outputs reach the consumer
        num_seen = len(outputs)
        await asyncio.sleep(0.3)
        assert len(outputs) == num_seen, "tokens were emitted while paused"
        assert not outputs[-1].finished and len(tokens_of(outputs, "delta")) < max_tokens
        request = await llm.run_in_engine(lambda core: core.scheduler.requests["frozen"])
        assert (
            request.num_preemptions > 0
        ) == clear_cache  # clear_cache preempted it (recompute after resume)
        await llm.resume_generation()
        assert not await llm.is_paused()
        await task
        assert tokens_of(outputs, "delta") == reference(prompt(9), max_tokens)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_wait_lets_running_finish_and_holds_new_until_resume(
    make_llm: Callable[..., AsyncLLM], clear_cache: bool
) -> None:
    llm = make_llm()

    async def main() -> None:
        running = llm.generate(prompt(11), params(60), request_id="running")
        await next_output(running)
        rest = asyncio.create_task(collect_rest(running))
        await llm.pause_generation(mode="wait", clear_cache=clear_cache)
        # it returned only once in effect: the running request is done, nothing is left in the core
        assert await llm.run_in_engine(
            lambda core: (core.pause_effective(), sorted(core.scheduler.requests))
        ) == (True, [])
        finished = await rest
        assert finished[-1].finished and tokens_of(finished) == reference(prompt(11), 60)
        assert finished[-1].outputs[0].finish_reason == "length"
        held_outputs: list[RequestOutput] = []
        held = asyncio.create_task(collect_into(llm, prompt(12), params(5), "held", held_outputs))
        await asyncio.sleep(0.2)
        assert held_outputs == []
        assert (
            await llm.run_in_engine(lambda core: core.scheduler.get_num_unfinished_requests()) == 1
        )
        await llm.resume_generation()
        await held
        assert tokens_of(held_outputs) == reference(prompt(12), 5)
        await wait_until_clean(llm)

    run(main())


async def collect_rest(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


async def collect_into(
    llm: AsyncLLM,
    prompt_: Any,
    sampling_params: SamplingParams,
    request_id: str,
    into: list[RequestOutput],
) -> None:
    async for output in llm.generate(prompt_, sampling_params, request_id):
        into.append(output)


@pytest.mark.parametrize("clear_cache", [True, False])
def test_pause_abort_ends_running_requests_and_queues_new_ones(
    make_llm: Callable[..., AsyncLLM], clear_cache: bool
) -> None:
    llm = make_llm()
    expected = reference(prompt(13), LONG)

    async def main() -> None:
        running = llm.generate(prompt(13), params(LONG), request_id="running")
        await next_output(running)
        await llm.pause_generation(mode="abort", clear_cache=clear_cache)
        final = [output async for output in running][-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        tokens = final.outputs[0].token_ids
        assert 1 <= len(tokens) < LONG and tokens == expected[: len(tokens)]
        await wait_until_clean(llm)
        # requests that arrive while paused wait, are visible, and are abortable
        queued_outputs: list[RequestOutput] = []
        dropped_outputs: list[RequestOutput] = []
        queued = asyncio.create_task(
            collect_into(llm, prompt(14), params(4), "queued", queued_outputs)
        )
        dropped = asyncio.create_task(
            collect_into(llm, prompt(15), params(4), "dropped", dropped_outputs)
        )
        await asyncio.sleep(0.1)
        assert await llm.run_in_engine(lambda core: sorted(core.scheduler.requests)) == [
            "dropped",
            "queued",
        ]
        await llm.abort("dropped")
        await dropped
        assert [
            (o.finished, o.outputs[0].finish_reason, o.outputs[0].token_ids)
            for o in dropped_outputs
        ] == [(True, "abort", [])]
        assert queued_outputs == []
        await llm.resume_generation()
        await queued
        assert tokens_of(queued_outputs) == reference(prompt(14), 4)

    run(main())


def test_invalid_pause_mode_and_weight_update_without_pause(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm()

    # A state dict crosses no process boundary: the engine process takes a checkpoint folder.
    weights: Any = "no-such-checkpoint" if uses_engine_process(llm) else {}

    async def main() -> None:
        with pytest.raises(ValueError, match="pause mode"):
            await llm.pause_generation(mode="freeze")
        assert not await llm.is_paused()
        with pytest.raises(RuntimeError, match="paused"):
            await llm.update_weights(weights)
        await llm.pause_generation(mode="keep")
        with pytest.raises(ValueError, match="hash test model"):
            await llm.update_weights(
                weights
            )  # the command's error reaches its caller; the engine lives on
        await llm.resume_generation()
        assert tokens_of(await collect(llm, prompt(1), params(3))) == reference(prompt(1), 3)

    run(main())


def test_concurrent_pause_and_resume_never_strand_a_caller(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm(max_num_seqs=4)
    cases = [(prompt(seed, 4 + seed), 20 + 5 * seed) for seed in range(8)]

    async def toggler(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(12):
            if rng.random() < 0.6:
                await llm.pause_generation(
                    mode=rng.choice(["keep", "wait"]), clear_cache=rng.random() < 0.5
                )
            else:
                await llm.resume_generation()
            await asyncio.sleep(rng.random() * 0.01)

    async def main() -> None:
        generations = asyncio.gather(*(collect(llm, p, params(n)) for p, n in cases))
        await asyncio.gather(*(toggler(seed) for seed in range(3)))
        # several pauses at once all return, and one resume releases everything
        await asyncio.gather(
            *(llm.pause_generation(mode="keep", clear_cache=False) for _ in range(3))
        )
        await asyncio.gather(llm.resume_generation(), llm.pause_generation(mode="wait"))
        await llm.resume_generation()
        results = await generations
        for (p, n), outputs in zip(cases, results, strict=True):
            assert tokens_of(outputs) == reference(p, n)
        assert not await llm.is_paused()
        await wait_until_clean(llm)

    run(main())


def test_resume_releases_a_pause_that_has_not_taken_effect(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm()

    async def main() -> None:
        stream = llm.generate(prompt(4), params(LONG), request_id="long")
        await next_output(stream)
        pausing = asyncio.create_task(llm.pause_generation(mode="wait"))
        await asyncio.sleep(0.05)
        assert not pausing.done()  # "wait" holds the caller while the long request runs
        await llm.resume_generation()
        await asyncio.wait_for(pausing, 5.0)
        assert not await llm.is_paused()
        assert tokens_of([output async for output in stream]) == reference(prompt(4), LONG)

    run(main())


def test_reset_prefix_cache_respects_running_requests(make_llm: Callable[..., AsyncLLM]) -> None:
    llm = make_llm()

    async def main() -> None:
        await collect(llm, prompt(20, 40), params(2))
        assert await llm.reset_prefix_cache()
        stream = llm.generate(prompt(21, 40), params(80), request_id="busy")
        await next_output(stream)
        await llm.pause_generation(mode="keep", clear_cache=False)
        assert not await llm.reset_prefix_cache()  # blocks in use
        assert await llm.reset_prefix_cache(reset_running_requests=True)
        await llm.resume_generation()
        assert tokens_of([output async for output in stream]) == reference(prompt(21, 40), 80)

    run(main())


# ------------------------------------------------------------------------------------------------ default model
@pytest.fixture(scope="module", params=[False, True], ids=["inproc", "proc"])
def text_llm(request: pytest.FixtureRequest) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(
        max_model_len=256, num_kv_blocks=64, max_num_seqs=4, engine_process=request.param
    )
    yield engine
    engine.shutdown()


def greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)


def test_default_model_streams_text_and_honours_stop_strings(text_llm: AsyncLLM) -> None:
    text = "The quick brown fox jumps over the lazy dog. Once upon a time"

    async def main() -> None:
        full = (await collect(text_llm, text, greedy(max_tokens=30)))[-1].outputs[0]
        assert full.text == text_llm.get_tokenizer().decode(full.token_ids) and full.text
        delta = await collect(text_llm, text, greedy(max_tokens=30, output_kind="delta"))
        assert "".join(output.outputs[0].text for output in delta) == full.text
        stop = full.text[8:11]
        first_match = full.text.index(stop)
        stopped = await collect(
            text_llm, text, greedy(max_tokens=30, stop=[stop], output_kind="delta")
        )
        assert "".join(output.outputs[0].text for output in stopped) == full.text[:first_match]
        assert stopped[-1].finished and stopped[-1].outputs[0].finish_reason == "stop"
        assert stopped[-1].outputs[0].stop_reason == stop
        assert not await text_llm.run_in_engine(
            lambda core: core.scheduler.requests
        )  # aborted in the core

    run(main())


def test_default_model_session_chunks_stream_text_and_a_stop_string_ends_the_session(
    text_llm: AsyncLLM,
) -> None:
    tokenizer = text_llm.get_tokenizer()
    first, second = "Once upon a time", " there was a fox"

    async def main() -> None:
        feed = ChunkFeed()
        stream = text_llm.generate(feed.items(), greedy(max_tokens=6, output_kind="delta"))
        feed.queue.put_nowait(StreamingInput(first))
        chunk = await read_chunk(stream)
        assert "".join(output.outputs[0].text for output in chunk) == tokenizer.decode(
            tokens_of(chunk, "delta")
        )
        feed.queue.put_nowait(
            StreamingInput({"prompt": second, "prompt_token_ids": tokenizer.encode(second)})
        )
        chunk = await read_chunk(stream)
        assert (
            chunk[-1].prompt == second
            and len(tokens_of(chunk, "delta")) == 6
            and not chunk[-1].finished
        )
        feed.end()
        assert [output.finished for output in [output async for output in stream]] == [True]

        full = (await collect(text_llm, first, greedy(max_tokens=30)))[-1].outputs[0].text
        stop = full[8:11]
        feed = ChunkFeed()
        feed.queue.put_nowait(StreamingInput(first, greedy(max_tokens=30, stop=[stop])))
        outputs = await collect(text_llm, feed.items())
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
        assert outputs[-1].outputs[0].text == full[: full.index(stop)]
        await asyncio.sleep(0.02)
        assert feed.closed and not await text_llm.run_in_engine(
            lambda core: core.scheduler.requests
        )

    run(main())


def test_default_model_weight_update_between_pause_and_resume(text_llm: AsyncLLM) -> None:
    async def main() -> None:
        before = (await collect(text_llm, "Hello", greedy(max_tokens=4)))[-1].outputs[0]
        await text_llm.pause_generation(mode="keep")
        version = await text_llm.update_weights(str(text_llm.model_info.path))
        assert version >= 1
        await text_llm.resume_generation()
        after = (await collect(text_llm, "Hello", greedy(max_tokens=4)))[-1].outputs[0]
        assert (
            after.weight_versions == [version] and after.token_ids == before.token_ids
        )  # same weights reloaded

    run(main())


# ------------------------------------------------------------------------------------------------ sessions
CHUNKS = [([5, 6, 7, 8, 9, 10, 11, 12, 13], 3), ([21, 22, 23, 24, 25], 4), ([31, 32], 2)]


@pytest.mark.parametrize("output_kind", ["cumulative", "delta", "final_only"])
def test_session_waits_for_each_chunk_and_closes_after_the_input_ends(
    make_llm: Callable[..., AsyncLLM], output_kind: str
) -> None:
    llm = make_llm()
    chunks = [(CHUNKS[0][0], 3), (CHUNKS[1][0], 4), (CHUNKS[2][0], 4)]
    # chunk 0 runs with generate()'s params, chunk 1 brings its own, chunk 2 (None) reuses chunk 1's
    chunk_params = [None, params(4, output_kind), None]
    expected = session_reference(chunks)

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3, output_kind), request_id="session")
        for index, (chunk, _) in enumerate(chunks):
            feed.send(chunk, chunk_params[index])
            outputs = await read_chunk(stream)
            assert tokens_of(outputs, output_kind) == expected[index]
            assert outputs[-1].outputs[0].finish_reason == "length"
            assert not any(output.finished for output in outputs), (
                "a chunk end is not the session's end"
            )
            if output_kind == "final_only":
                assert len(outputs) == 1
            request = await llm.run_in_engine(lambda core: core.scheduler.requests["session"])
            assert request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
            with pytest.raises(
                ValueError, match="already in use"
            ):  # never mistaken for the session's next chunk
                await collect(llm, prompt(2), params(2), request_id="session")
            snapshot = await llm.run_in_engine(engine_snapshot)
            assert (
                snapshot["slot_holders"] == 1 and snapshot["usage"] > 0
            )  # it keeps its slot and blocks
            if (
                index == 0
            ):  # a cache-clearing pause releases the idle session; its next chunk recomputes
                await llm.pause_generation(mode="keep", clear_cache=True)
                assert (await llm.run_in_engine(engine_snapshot))["slot_holders"] == 0
                await llm.resume_generation()
        feed.end()
        [closing] = [output async for output in stream]
        assert closing.finished and closing.outputs[0].finish_reason == "length"
        assert closing.outputs[0].token_ids == ([] if output_kind == "delta" else expected[-1])
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize(
    ("async_scheduling", "use_v2_model_runner"), [(True, True), (False, True), (True, False)]
)
def test_session_with_all_chunks_queued_up_front(
    make_llm: Callable[..., AsyncLLM], async_scheduling: bool, use_v2_model_runner: bool
) -> None:
    llm = make_llm(async_scheduling=async_scheduling, use_v2_model_runner=use_v2_model_runner)
    expected = session_reference(CHUNKS)

    async def main() -> None:
        feed = ChunkFeed()
        for chunk, max_tokens in CHUNKS:
            feed.send(chunk, params(max_tokens))
        feed.end()
        outputs = await collect(llm, feed.items())
        chunk_ends = [output for output in outputs if output.outputs[0].finish_reason is not None]
        assert [output.outputs[0].token_ids for output in chunk_ends] == expected
        assert [output.finished for output in chunk_ends] == [False, False, True]
        assert outputs[-1] is chunk_ends[-1]  # the last chunk's end is the session's end
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("when", ["idle", "running", "paused_abort"])
def test_session_abort_ends_it_with_abort(make_llm: Callable[..., AsyncLLM], when: str) -> None:
    llm = make_llm()
    expected = session_reference([(CHUNKS[0][0], 3), ([40, 41], LONG)])

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        feed.send(CHUNKS[0][0])
        await read_chunk(stream)
        if when == "running":
            feed.send([40, 41], params(LONG))
            await next_output(stream)
        if when == "paused_abort":
            await llm.pause_generation(mode="abort")
        else:
            await llm.abort("session")
        rest = [output async for output in stream]
        final = rest[-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        if when == "running":
            tokens = final.outputs[0].token_ids
            assert 1 <= len(tokens) < LONG and tokens == expected[1][: len(tokens)]
        else:
            assert rest == [final] and final.outputs[0].token_ids == expected[0]
        await asyncio.sleep(0.02)
        assert feed.closed, "the input iterator was not cancelled"
        if when == "paused_abort":
            await llm.resume_generation()
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("when", ["idle", "running"])
def test_session_consumer_leaving_cancels_input_and_frees_everything(
    make_llm: Callable[..., AsyncLLM], when: str
) -> None:
    llm = make_llm()

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        feed.send(CHUNKS[0][0])
        await read_chunk(stream)
        if when == "running":
            feed.send([40, 41], params(LONG))
            await next_output(stream)
        assert (await llm.run_in_engine(engine_snapshot))["slot_holders"] == 1
        await stream.aclose()
        await wait_until_clean(llm)
        await asyncio.sleep(0.02)
        assert feed.closed

    run(main())


@pytest.mark.parametrize("queued", [False, True])
def test_session_chunk_past_max_model_len_raises_and_ends_it(
    make_llm: Callable[..., AsyncLLM], queued: bool
) -> None:
    llm = make_llm(max_model_len=64, num_kv_blocks=64)

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        feed.send(list(range(1, 41)))
        if queued:
            feed.send(
                list(range(100, 125))
            )  # 40 + 2 kept outputs + 25 > 64, arrives while chunk 1 runs
        outputs = await read_chunk(stream)
        assert tokens_of(outputs) == reference_tokens(list(range(1, 41)), 3)
        if not queued:
            feed.send(list(range(100, 125)))
        with pytest.raises(ValueError, match="max_model_len=64"):
            await next_output(stream)
        await asyncio.sleep(0.02)
        assert feed.closed
        await wait_until_clean(llm)

    run(main())


@pytest.mark.parametrize("when", ["first", "idle", "running"])
def test_session_input_error_is_raised_to_the_consumer(
    make_llm: Callable[..., AsyncLLM], when: str
) -> None:
    llm = make_llm()

    class Boom(Exception):
        pass

    async def main() -> None:
        feed = ChunkFeed()
        stream = llm.generate(feed.items(), params(3), request_id="session")
        if when != "first":
            feed.send(CHUNKS[0][0])
            await read_chunk(stream)
        if when == "running":
            feed.send([40, 41], params(LONG))
            await next_output(stream)
        feed.fail(Boom("input broke"))
        with pytest.raises(Boom, match="input broke"):
            async for output in stream:
                assert not output.finished
        await wait_until_clean(llm)
        # an invalid chunk is a ValueError, raised the same way
        bad = ChunkFeed()
        bad.send([1, -2])
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await collect(llm, bad.items(), request_id="session")
        with pytest.raises(ValueError, match="n=1"):
            await collect(llm, ChunkFeed().items(), params(3, n=2))

    run(main())


# ------------------------------------------------------------------------------------------------ errors, shutdown
def test_engine_error_reaches_every_consumer_and_later_calls_fail(
    make_llm: Callable[..., AsyncLLM],
) -> None:
    llm = make_llm()

    class WorkerCrash(RuntimeError):
        pass

    def crash(*args: object, **kwargs: object) -> None:
        raise WorkerCrash("device lost")

    async def main() -> None:
        streams = [llm.generate(prompt(seed), params(LONG)) for seed in range(3)]
        for stream in streams:
            await next_output(stream)
        feed = ChunkFeed()
        session = llm.generate(feed.items(), params(2))
        feed.send([1, 2, 3])
        await read_chunk(session)
        await llm.run_in_engine(lambda core: setattr(core.executor, "execute_model", crash))
        for stream in [*streams, session]:
            with pytest.raises(EngineDeadError) as info:
                async for _ in stream:
                    pass
            assert isinstance(info.value.__cause__, WorkerCrash)
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await collect(llm, prompt(1), params(2))
        with pytest.raises(EngineDeadError):
            await llm.pause_generation()
        llm.shutdown()
        llm.shutdown()

    run(main())


def test_shutdown_ends_live_requests_and_is_idempotent(make_llm: Callable[..., AsyncLLM]) -> None:
    llm = make_llm()

    async def main() -> None:
        stream = llm.generate(prompt(2), params(LONG), request_id="live")
        await next_output(stream)
        llm.shutdown()
        final = [output async for output in stream][-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        llm.shutdown()
        assert not llm.errored
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(llm, prompt(1), params(2))
        with pytest.raises(EngineDeadError, match="shut down"):
            await llm.is_paused()

    run(main())
    assert not llm.engine_core_client.is_alive()

    async def with_block() -> AsyncLLM:
        async with make_llm() as engine:
            assert tokens_of(await collect(engine, prompt(3), params(2))) == reference(prompt(3), 2)
        return engine

    engine = run(with_block())
    assert not engine.engine_core_client.is_alive()
    with pytest.raises(EngineDeadError):
        run(collect(engine, prompt(3), params(2)))
