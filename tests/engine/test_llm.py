"""The offline LLM API end to end on the hash model: exact tokens, order, validation, metrics."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from kvflow import LLM, RequestOutput, SamplingParams
from kvflow.engine.death import EngineDeadError
from kvflow.testing.hash_model import reference_tokens


def small_llm(**overrides: object) -> LLM:
    options: dict[str, object] = dict(
        max_num_seqs=8, num_kv_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=32
    )
    options.update(overrides)
    return LLM("hash", **options)  # type: ignore[arg-type]


def prompts_of(lengths: list[int]) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [(i * 31 + j) % 997 + 1 for j in range(length)]}
        for i, length in enumerate(lengths)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_generate_returns_reference_tokens_in_input_order(
    async_scheduling: bool, use_v2_model_runner: bool
) -> None:
    llm = small_llm(async_scheduling=async_scheduling, use_v2_model_runner=use_v2_model_runner)
    prompts = prompts_of([3, 40, 7, 60, 1, 25, 33, 12, 5, 48, 19, 2])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
    assert [output.prompt_token_ids for output in outputs] == [
        p["prompt_token_ids"] for p in prompts
    ]
    for output, prompt in zip(outputs, prompts, strict=True):
        assert isinstance(output, RequestOutput) and output.finished
        assert output.outputs[0].token_ids == reference_tokens(prompt["prompt_token_ids"], 9)
        assert output.outputs[0].finish_reason == "length"


def test_per_prompt_sampling_params_apply_to_their_prompt() -> None:
    llm = small_llm()
    prompts = prompts_of([5, 6, 7])
    params = [SamplingParams(max_tokens=n) for n in (1, 4, 2)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(output.outputs[0].token_ids) for output in outputs] == [1, 4, 2]


def test_stop_token_ids_end_generation_with_stop_reason() -> None:
    llm = small_llm()
    prompt = prompts_of([10])[0]
    expected = reference_tokens(prompt["prompt_token_ids"], 8)
    output = llm.generate(
        prompt, SamplingParams(max_tokens=8, stop_token_ids=[expected[2]]), use_tqdm=False
    )[0]
    assert output.outputs[0].token_ids == expected[:3]
    assert output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].stop_reason == expected[2]


def test_shared_prefixes_hit_the_prefix_cache_and_stay_correct() -> None:
    llm = small_llm(num_kv_blocks=200, max_num_batched_tokens=256)
    shared = list(range(1, 41))
    prompts = [{"prompt_token_ids": [*shared, 100 + i, 200 + i]} for i in range(6)]
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    rest = llm.generate(prompts[1:], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.prefix_cache_hit_rate > 0.5
    assert all(
        output.metrics is not None and output.metrics.num_cached_tokens == 40 for output in rest
    )
    for output, prompt in zip(first + rest, prompts, strict=True):
        assert output.outputs[0].token_ids == reference_tokens(prompt["prompt_token_ids"], 4)


def test_kv_pressure_preempts_yet_outputs_stay_exact() -> None:
    llm = small_llm(num_kv_blocks=40, max_model_len=120)
    prompts = prompts_of([30] * 8)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40), use_tqdm=False)
    scheduler = llm.run_in_engine(lambda core: core.scheduler)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 40
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.outputs[0].token_ids == reference_tokens(prompt["prompt_token_ids"], 40)


def test_bad_prompt_raises_and_leaves_engine_usable() -> None:
    llm = small_llm()
    good = prompts_of([4])[0]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([good, {"prompt_token_ids": [1, -5]}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 129}, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate([good], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not llm.run_in_engine(lambda core: core.scheduler.requests)
    output = llm.generate(good, SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert output.outputs[0].token_ids == reference_tokens(good["prompt_token_ids"], 3)


def test_max_model_len_larger_than_kv_cache_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM("hash", num_kv_blocks=4, block_size=4, max_model_len=64)


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        LLM("/no/such/checkpoint")


def test_metrics_record_first_token_and_finish_times() -> None:
    llm = small_llm()
    output = llm.generate(prompts_of([5])[0], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    metrics = output.metrics
    assert (
        metrics is not None
        and metrics.first_token_time is not None
        and metrics.finished_time is not None
    )
    assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time


def test_progress_bar_reports_requests(capsys: pytest.CaptureFixture[str]) -> None:
    llm = small_llm()
    llm.generate(prompts_of([3, 4]), SamplingParams(max_tokens=2), use_tqdm=True)
    assert "2/2" in capsys.readouterr().err


def engine_loop_threads() -> int:
    return sum(thread.name == "kvflow-engine-core" for thread in threading.enumerate())


def test_an_llm_that_is_garbage_collected_stops_its_engine_loop() -> None:
    """The client's handlers hold no reference to the LLM: dropping the last one stops the loop and frees the
    core (its model and KV cache), and `shutdown` makes every later call fail with EngineDeadError."""
    before = engine_loop_threads()
    llm = small_llm()
    assert engine_loop_threads() == before + 1
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
    del llm
    gc.collect()
    deadline = time.monotonic() + 30
    while engine_loop_threads() != before:
        assert time.monotonic() < deadline, "the collected LLM's engine loop still runs"
        time.sleep(0.01)
    stopped = small_llm()
    stopped.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        stopped.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
