"""`SamplingParams.prompt_logprobs` end to end, against transformers' float32 log_softmax on a real checkpoint.

What lm-evaluation-harness relies on (`echo` + `logprobs` scoring): one entry per prompt token, entry 0 None,
entry i the distribution at position i given tokens < i with the actual token first (with its rank) and then the
top k in rank order; the same values however the prompt is computed (one step, chunked, preempted and recomputed,
after an identical prefix was cached, with async scheduling, with either runner protocol).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from kvflow import LLM, AsyncLLM, RequestOutput, SamplingParams, StreamingInput
from kvflow.outputs import PromptLogprobs
from kvflow.testing.hf_checkpoints import hf_greedy, hf_logits, load_hf_model, make_tiny_checkpoint
from kvflow.testing.streams import check_stream_shape, fold_outputs

TOLERANCE = 1e-4
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path):  # type: ignore[no-untyped-def]
    return load_hf_model(checkpoint)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(length)] for length in lengths]


def check_prompt_logprobs(
    prompt_logprobs: PromptLogprobs | None, prompt: list[int], reference: torch.Tensor, k: int
) -> None:
    """Entry i: the actual token first with its rank, then transformers' top k in rank order, values within 1e-4."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = prompt_logprobs[i]
        assert entry is not None
        expected = reference[i - 1]
        actual = prompt[i]
        top = expected.topk(k).indices.tolist()
        assert list(entry) == [actual] + [token for token in top if token != actual]
        assert entry[actual].rank == int((expected > expected[actual]).sum()) + 1
        for rank, token in enumerate(top, 1):
            assert entry[token].rank == rank
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[token].item(), abs=TOLERANCE)


def references(checkpoint: Path, hf_model, prompts: list[list[int]]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    return [hf_logits(checkpoint, prompt, hf_model).log_softmax(dim=-1) for prompt in prompts]


def scored(k: int | None, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k
    )


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):  # type: ignore[no-untyped-def]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_one_step_prompt_logprobs_match_transformers(checkpoint: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    prompts = prompts_of([17, 17, 9], seed=1)
    expected = references(checkpoint, hf_model, prompts)
    llm = LLM(str(checkpoint), num_kv_blocks=128, **ENGINE)
    outputs = generate(llm, prompts, [scored(0), scored(5), scored(None)])
    check_prompt_logprobs(outputs[0].prompt_logprobs, prompts[0], expected[0], k=0)
    check_prompt_logprobs(outputs[1].prompt_logprobs, prompts[1], expected[1], k=5)
    assert outputs[2].prompt_logprobs is None
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, 4, hf_model)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_chunked_prefill_gives_the_same_prompt_logprobs(
    checkpoint: Path,
    hf_model,  # type: ignore[no-untyped-def]
    async_scheduling: bool,
    use_v2_model_runner: bool,
) -> None:
    prompts = prompts_of([1, 2, 9, 23, 40], seed=2)
    expected = references(checkpoint, hf_model, prompts)
    llm = LLM(
        str(checkpoint),
        num_kv_blocks=128,
        max_num_batched_tokens=8,  # every prompt longer than 8 tokens is split
        async_scheduling=async_scheduling,
        use_v2_model_runner=use_v2_model_runner,
        **ENGINE,
    )
    outputs = generate(llm, prompts, scored(2))
    assert outputs[0].prompt_logprobs == [None]  # a one-token prompt has nothing before its token
    for output, prompt, reference in zip(outputs[1:], prompts[1:], expected[1:], strict=True):
        check_prompt_logprobs(output.prompt_logprobs, prompt, reference, k=2)
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, 4, hf_model)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs_and_still_filled(
    checkpoint: Path,
    hf_model,  # type: ignore[no-untyped-def]
) -> None:
    [prompt] = prompts_of([30], seed=3)
    [reference] = references(checkpoint, hf_model, [prompt])
    llm = LLM(str(checkpoint), num_kv_blocks=128, **ENGINE)
    [plain] = generate(llm, [prompt], scored(None))
    [with_logprobs] = generate(llm, [prompt], scored(3))
    [again] = generate(llm, [prompt], scored(None))
    assert plain.metrics is not None and plain.metrics.num_cached_tokens == 0
    assert with_logprobs.metrics is not None and with_logprobs.metrics.num_cached_tokens == 0
    assert again.metrics is not None and again.metrics.num_cached_tokens == 28  # 7 full blocks
    check_prompt_logprobs(with_logprobs.prompt_logprobs, prompt, reference, k=3)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_prompts_keep_one_entry_per_token(
    checkpoint: Path,
    hf_model,  # type: ignore[no-untyped-def]
    async_scheduling: bool,
) -> None:
    prompts = prompts_of([26, 31, 22, 29], seed=4)
    expected = references(checkpoint, hf_model, prompts)
    llm = LLM(
        str(checkpoint),
        num_kv_blocks=24,  # 96 token slots for four prompts of ~27 tokens + 16 outputs each
        max_num_batched_tokens=16,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
        **{**ENGINE, "max_model_len": 64},
    )
    outputs = generate(llm, prompts, scored(1, max_tokens=16))
    assert sum(output.metrics.num_preemptions for output in outputs if output.metrics) > 0
    for output, prompt, reference in zip(outputs, prompts, expected, strict=True):
        check_prompt_logprobs(output.prompt_logprobs, prompt, reference, k=1)
        assert output.outputs[0].token_ids == hf_greedy(checkpoint, prompt, 16, hf_model)


def test_parallel_samples_share_one_computation(checkpoint: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    [prompt] = prompts_of([21], seed=5)
    [reference] = references(checkpoint, hf_model, [prompt])
    llm = LLM(str(checkpoint), num_kv_blocks=128, **ENGINE)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, prompt_logprobs=2)
    [output] = generate(llm, [prompt], params)
    assert len(output.outputs) == 3
    check_prompt_logprobs(output.prompt_logprobs, prompt, reference, k=2)
    requests = llm.input_processor.make_requests(
        "x", llm.input_processor.process({"prompt_token_ids": prompt}, params), 0.0
    )
    assert [r.sampling_params.prompt_logprobs for r in requests] == [2, None, None]


# ------------------------------------------------------------------------------------------------ output kinds
async def stream(
    engine: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    return [
        output async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id)
    ]


@pytest.mark.parametrize("n", [1, 2])
def test_output_kinds_carry_prompt_logprobs_once_complete(
    checkpoint: Path,
    hf_model,  # type: ignore[no-untyped-def]
    n: int,
) -> None:
    [prompt] = prompts_of([19], seed=6)
    [reference] = references(checkpoint, hf_model, [prompt])

    async def run() -> dict[str, list[RequestOutput]]:
        engine = AsyncLLM(str(checkpoint), num_kv_blocks=128, max_num_batched_tokens=8, **ENGINE)
        try:
            return {
                kind: await stream(
                    engine,
                    prompt,
                    SamplingParams(
                        n=n,
                        temperature=0.0,
                        max_tokens=4,
                        ignore_eos=True,
                        prompt_logprobs=1,
                        output_kind=kind,  # type: ignore[arg-type]
                    ),
                    kind,
                )
                for kind in ("cumulative", "delta", "final_only")
            }
        finally:
            engine.shutdown()

    outputs = asyncio.run(run())
    cumulative, delta, final_only = outputs["cumulative"], outputs["delta"], outputs["final_only"]
    for kind, outputs in (("cumulative", cumulative), ("delta", delta), ("final_only", final_only)):
        check_stream_shape(outputs, kind)  # how many outputs depends on timing: they coalesce
    assert [len(c.token_ids) for c in fold_outputs(delta, "delta").outputs] == [4] * n
    for output in cumulative:  # the first output already has a token, so every one has them
        check_prompt_logprobs(output.prompt_logprobs, prompt, reference, k=1)
    # Delta: once, on the first output after they are complete (for n > 1, when sample 0's first token is in).
    carrying = [index for index, output in enumerate(delta) if output.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] < n
    check_prompt_logprobs(delta[carrying[0]].prompt_logprobs, prompt, reference, k=1)
    check_prompt_logprobs(final_only[0].prompt_logprobs, prompt, reference, k=1)


# ------------------------------------------------------------------------------------------------ validation
def test_prompt_logprobs_are_validated_like_logprobs(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), num_kv_blocks=64, max_logprobs=3, **ENGINE)
    with pytest.raises(ValueError, match=r"prompt_logprobs=4 .*max_logprobs=3"):
        generate(llm, [[5, 6, 7]], scored(4))
    with pytest.raises(ValueError, match=r"\bprompt_logprobs\b"):
        scored(-1)
    [output] = generate(llm, [[5, 6, 7]], scored(3))
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == 3


@pytest.mark.parametrize("field_name", ["prompt_logprobs", "logprobs"])
def test_the_hash_model_has_no_logits_to_score(field_name: str) -> None:
    llm = LLM("hash", max_model_len=64, num_kv_blocks=32, block_size=4)
    with pytest.raises(ValueError, match=rf"\b{field_name}=0: the hash model .* no logits"):
        llm.generate(
            {"prompt_token_ids": [1, 2]}, SamplingParams(**{field_name: 0}), use_tqdm=False
        )
    assert llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_streaming_session_cannot_ask_for_prompt_logprobs(checkpoint: Path) -> None:
    async def chunks() -> AsyncIterator[StreamingInput]:
        yield StreamingInput({"prompt_token_ids": [5, 6, 7]})

    async def run() -> None:
        engine = AsyncLLM(str(checkpoint), num_kv_blocks=64, **ENGINE)
        try:
            async for _ in engine.generate(chunks(), scored(1), "session"):
                pass
        finally:
            engine.shutdown()

    with pytest.raises(ValueError, match="prompt_logprobs is not supported for a streaming-input"):
        asyncio.run(run())
