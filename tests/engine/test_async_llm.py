"""AsyncLLM end to end: streaming kinds, concurrency, aborts and cancellation, engine errors and shutdown. The hash
model is the oracle (exact tokens). Pause / resume, sessions and the default model's text are in the sibling
test_async_llm_*.py files; the shared helpers in async_llm_helpers.py, the fixtures in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

import pytest

from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.testing.streams import check_stream_shape, fold_outputs
from tests.engine.async_llm_helpers import (
    LONG,
    ChunkFeed,
    collect,
    engine_snapshot,
    next_output,
    params,
    prompt,
    read_chunk,
    reference,
    run,
    tokens_of,
    wait_until_clean,
)


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
