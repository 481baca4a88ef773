"""The thread-safe LLM under pause / resume from other threads: one thread runs `generate` while others pause (every
mode), resume, pause concurrently and update weights. No caller may be stranded (every join has a timeout), every
result is exact (or, when an abort pause ended it, a prefix of the exact output); on a real tiny checkpoint a
pause(keep, clear_cache=True) + resume in the middle leaves greedy outputs unchanged, and weight updates show in
the outputs (`CompletionOutput.weight_versions`) and, for changed weights, in the tokens.

To land a pause at a chosen point of a generation, `StepGate` wraps the engine core's `step` (installed where the
core runs, through `LLM.run_in_engine`): after a given number of steps it signals the controlling thread and holds
the engine loop until the controller has queued its pause, so the pause is applied right after that step.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, RequestOutput, SamplingParams
from kvflow.engine.core import EngineCore
from kvflow.testing.hash_model import reference_tokens
from kvflow.testing.waiting import wait_until

JOIN_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------------- helpers
class StepGate:
    """Holds the engine loop after its `after_steps`-th step until the controller `open()`s it (or a deadline
    passes: a loop held forever would strand every caller)."""

    def __init__(self, after_steps: int) -> None:
        self.after_steps = after_steps
        self.num_steps = 0
        self.reached = threading.Event()
        self.opened = threading.Event()

    def install(self, core: EngineCore) -> None:
        run_step = core.step

        def step_then_hold() -> Any:
            outputs = run_step()
            self.num_steps += 1
            if self.num_steps == self.after_steps:
                self.reached.set()
                self.opened.wait(JOIN_TIMEOUT_S)
            return outputs

        core.step = step_then_hold  # type: ignore[method-assign]

    def wait(self) -> None:
        """Controller side: block until the engine loop is held after the chosen step."""
        assert self.reached.wait(JOIN_TIMEOUT_S), "the generation never reached the gate"

    def open(self) -> None:
        self.opened.set()


def install_gate(llm: LLM, after_steps: int) -> StepGate:
    gate = StepGate(after_steps)
    llm.run_in_engine(gate.install)
    return gate


def pause_at_gate(llm: LLM, gate: StepGate, mode: str, clear_cache: bool = True) -> None:
    """Controller side: once the loop is held at the gate, queue a pause (applied before the next step), let the
    loop go and return once the pause is in effect."""
    gate.wait()
    paused: Future[None] = llm.engine_core_client.pause_generation(mode, clear_cache)
    gate.open()
    paused.result(JOIN_TIMEOUT_S)


def run_threads(*targets: Callable[[], Any]) -> list[Any]:
    """Run each target on its own thread; fail if any is still running after the timeout or raised."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def wrap(index: int, target: Callable[[], Any]) -> None:
        try:
            results[index] = target()
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=wrap, args=(index, target), daemon=True)
        for index, target in enumerate(targets)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stranded = [thread.name for thread in threads if thread.is_alive()]
    assert not stranded, f"callers stranded: {stranded}"
    if errors:
        raise errors[0]
    return [results[index] for index in range(len(targets))]


def hash_llm(**overrides: Any) -> LLM:
    options: dict[str, Any] = dict(
        max_num_seqs=4, num_kv_blocks=96, block_size=4, max_model_len=128, max_num_batched_tokens=32
    )
    options.update(overrides)
    return LLM("hash", **options)


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 900) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    return llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )


def progress(llm: LLM) -> dict[str, int]:
    """Tokens so far of every request the LLM still tracks (finished ones are gone), read under its lock."""
    with llm._outputs.lock:
        return {
            request_id: len(state.output_token_ids)
            for request_id, state in llm.output_processor.request_states.items()
        }


def check_exact_or_aborted_prefix(
    outputs: list[RequestOutput], prompts: list[list[int]], max_tokens: int
) -> int:
    """Returns how many were aborted."""
    num_aborted = 0
    for output, prompt in zip(outputs, prompts, strict=True):
        completion = output.outputs[0]
        expected = reference_tokens(prompt, max_tokens)
        if completion.finish_reason == "abort":
            num_aborted += 1
            assert completion.token_ids == expected[: len(completion.token_ids)]
        else:
            assert completion.token_ids == expected and completion.finish_reason == "length"
    return num_aborted


def check_engine_clean(llm: LLM) -> None:
    """Once the worker has heard the last finishes (the loop steps until it has), nothing is left anywhere."""
    assert not llm.is_paused()
    wait_until(lambda: not llm.run_in_engine(EngineCore.has_work), "the engine has no work left")

    def held(core: EngineCore) -> tuple[int, int, int, int]:
        pool = core.scheduler.kv_cache_manager.block_pool
        slots = core.executor.worker.model_runner.slots
        return (
            pool.get_num_free_blocks(),
            pool.num_blocks,
            len(slots.free_indices),
            slots.max_num_reqs,
        )

    free_blocks, num_blocks, free_slots, num_slots = llm.run_in_engine(held)
    assert free_blocks == num_blocks and free_slots == num_slots


SCHEDULING = {"sync": False, "async": True}


# ---------------------------------------------------------------------------------------------------- hash model
@pytest.mark.parametrize("clear_cache", [False, True])
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_keep_from_another_thread_freezes_generation_until_resume(
    scheduling: str, clear_cache: bool
) -> None:
    llm = hash_llm(async_scheduling=SCHEDULING[scheduling])
    prompts = prompts_of(6)
    gate = install_gate(llm, after_steps=6)
    seen: dict[str, Any] = {}

    def controller() -> None:
        pause_at_gate(llm, gate, "keep", clear_cache)
        assert llm.is_paused() and llm.run_in_engine(EngineCore.pause_effective)
        seen["at_pause"] = frozen = progress(llm)
        time.sleep(0.1)  # the engine loop keeps looking for work: nothing may move
        assert progress(llm) == frozen
        llm.pause_generation(mode="keep", clear_cache=clear_cache)  # repeated: harmless
        assert progress(llm) == frozen
        llm.resume_generation()

    outputs, _ = run_threads(lambda: generate(llm, prompts, 24), controller)
    assert check_exact_or_aborted_prefix(outputs, prompts, 24) == 0
    assert any(0 < count < 24 for count in seen["at_pause"].values()), (
        seen
    )  # it really paused mid-generation
    check_engine_clean(llm)


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_wait_from_another_thread_finishes_started_requests_and_holds_the_rest(
    scheduling: str,
) -> None:
    llm = hash_llm(async_scheduling=SCHEDULING[scheduling], max_num_seqs=3)
    prompts = prompts_of(7, seed=1)
    gate = install_gate(llm, after_steps=4)
    seen: dict[str, Any] = {}

    def held_requests(core: EngineCore) -> list[tuple[int, int]]:
        return [
            (request.num_output_tokens, request.num_computed_tokens)
            for request in core.scheduler.requests.values()
        ]

    def controller() -> None:
        pause_at_gate(llm, gate, "wait", clear_cache=False)
        requests = llm.run_in_engine(held_requests)
        seen["held"] = len(requests)
        assert all(counts == (0, 0) for counts in requests)
        frozen = progress(llm)
        assert set(frozen.values()) == {0}
        time.sleep(0.1)
        assert progress(llm) == frozen
        llm.resume_generation()

    outputs, _ = run_threads(lambda: generate(llm, prompts, 20), controller)
    assert check_exact_or_aborted_prefix(outputs, prompts, 20) == 0
    assert 0 < seen["held"] < len(prompts)
    check_engine_clean(llm)


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_abort_from_another_thread_and_a_generate_that_arrives_while_paused(
    scheduling: str,
) -> None:
    llm = hash_llm(async_scheduling=SCHEDULING[scheduling])
    prompts, late_prompts = prompts_of(6, seed=2), prompts_of(3, seed=3)
    gate = install_gate(llm, after_steps=5)
    queued = threading.Event()
    late_started = threading.Event()

    def num_unfinished(core: EngineCore) -> int:
        return core.scheduler.get_num_unfinished_requests()

    def controller() -> None:
        pause_at_gate(llm, gate, "abort")
        assert llm.run_in_engine(EngineCore.pause_effective)
        late_started.set()
        wait_until(
            lambda: llm.run_in_engine(num_unfinished) >= len(late_prompts),
            "the late requests are queued",
        )
        queued.set()
        time.sleep(0.05)
        assert set(progress(llm).values()) == {0}  # queued, not served
        llm.resume_generation()

    def late() -> list[RequestOutput]:
        assert late_started.wait(JOIN_TIMEOUT_S)
        return generate(llm, late_prompts, 10)

    outputs, _, late_outputs = run_threads(lambda: generate(llm, prompts, 30), controller, late)
    assert queued.is_set()
    assert check_exact_or_aborted_prefix(outputs, prompts, 30) == len(prompts)
    assert all(
        len(output.outputs[0].token_ids) > 0 for output in outputs[:4]
    )  # aborted mid-generation
    assert check_exact_or_aborted_prefix(late_outputs, late_prompts, 10) == 0
    check_engine_clean(llm)


def test_pause_rejects_an_unknown_mode_and_resume_without_pause_is_harmless() -> None:
    llm = hash_llm()
    with pytest.raises(ValueError, match="mode"):
        llm.pause_generation(mode="stop")
    assert not llm.is_paused()
    llm.resume_generation()
    prompts = prompts_of(3, seed=4)
    assert check_exact_or_aborted_prefix(generate(llm, prompts, 8), prompts, 8) == 0


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_concurrent_pauses_resumes_and_weight_updates_strand_no_caller(scheduling: str) -> None:
    llm = hash_llm(async_scheduling=SCHEDULING[scheduling], max_num_seqs=3, num_kv_blocks=40)
    batches = [prompts_of(5, seed=10 + index) for index in range(4)]
    stats = {"pauses": 0, "weight_update_refusals": 0}

    def generator(first: int) -> list[tuple[list[list[int]], list[RequestOutput]]]:
        return [(batches[index], generate(llm, batches[index], 16)) for index in (first, first + 2)]

    def controller(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(8):
            time.sleep(rng.random() * 0.004)
            llm.pause_generation(
                mode=rng.choice(["abort", "wait", "keep", "keep"]), clear_cache=rng.random() < 0.5
            )
            stats["pauses"] += 1
            if rng.random() < 0.5:
                llm.pause_generation(mode="keep", clear_cache=rng.random() < 0.5)  # repeated pause
            if rng.random() < 0.5:
                # Paused (unless another controller resumed meanwhile): the hash model refuses, never a crash.
                with pytest.raises((ValueError, RuntimeError)) as refusal:
                    llm.update_weights({})
                stats["weight_update_refusals"] += 1
                assert "weights" in str(refusal.value)
            time.sleep(rng.random() * 0.004)
            llm.resume_generation()

    results = run_threads(
        lambda: generator(0),
        lambda: generator(1),
        *(lambda seed=seed: controller(seed) for seed in range(3)),
    )
    assert stats["pauses"] == 24
    for batch_results in results[:2]:
        for prompts, outputs in batch_results:
            check_exact_or_aborted_prefix(outputs, prompts, 16)
    llm.resume_generation()
    check_engine_clean(llm)
    prompts = prompts_of(4, seed=20)
    assert check_exact_or_aborted_prefix(generate(llm, prompts, 12), prompts, 12) == 0


# ---------------------------------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def real_llm(checkpoint: Path, **overrides: Any) -> LLM:
    options: dict[str, Any] = dict(
        max_model_len=128,
        block_size=4,
        num_kv_blocks=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    options.update(overrides)
    return LLM(str(checkpoint), dtype="float32", skip_tokenizer_init=True, **options)


REAL_PROMPTS = [
    [(7 * index + 3 * position) % 300 + 3 for position in range(5 + 6 * index)]
    for index in range(5)
]
REAL_MAX_TOKENS = 14


def real_generate(llm: LLM, prompts: list[list[int]] = REAL_PROMPTS) -> list[RequestOutput]:
    return llm.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        SamplingParams(temperature=0.0, max_tokens=REAL_MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_real_model_pause_keep_with_clear_cache_keeps_greedy_outputs(
    checkpoint: Path, scheduling: str
) -> None:
    expected = token_ids(
        real_generate(real_llm(checkpoint, async_scheduling=SCHEDULING[scheduling]))
    )
    llm = real_llm(checkpoint, async_scheduling=SCHEDULING[scheduling])
    gate = install_gate(llm, after_steps=6)
    seen: dict[str, Any] = {}

    def controller() -> None:
        pause_at_gate(llm, gate, "keep", clear_cache=True)
        seen["at_pause"] = progress(llm)
        # preempted: they recompute after resume
        assert not llm.run_in_engine(lambda core: core.scheduler.running)
        llm.resume_generation()

    outputs, _ = run_threads(lambda: real_generate(llm), controller)
    assert token_ids(outputs) == expected
    assert any(0 < count < REAL_MAX_TOKENS for count in seen["at_pause"].values()), seen
    assert llm.scheduler_stats()[0].num_preemptions_total > 0
    check_engine_clean(llm)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_real_model_update_weights_with_the_same_checkpoint_keeps_outputs(
    checkpoint: Path, clear_cache: bool
) -> None:
    expected = token_ids(real_generate(real_llm(checkpoint)))
    llm = real_llm(checkpoint)
    with pytest.raises(RuntimeError, match="paused"):
        llm.update_weights(str(checkpoint))
    gate = install_gate(llm, after_steps=6)
    seen: dict[str, Any] = {}

    def controller() -> None:
        pause_at_gate(llm, gate, "keep", clear_cache)
        seen["at_pause"] = progress(llm)
        # Between engine steps of an effective pause nothing is in flight, even right after the pause preempted
        # every request (clear_cache): the weights can change at once.
        seen["version"] = llm.update_weights(str(checkpoint))
        assert llm.reset_prefix_cache(reset_running_requests=True)
        llm.resume_generation()

    outputs, _ = run_threads(lambda: real_generate(llm), controller)
    assert seen["version"] == 1
    assert token_ids(outputs) == expected
    for output in outputs:
        num_before = seen["at_pause"].get(output.request_id, REAL_MAX_TOKENS)
        versions = output.outputs[0].weight_versions
        assert versions == (
            [0, 1] if 0 < num_before < REAL_MAX_TOKENS else [1] if num_before == 0 else [0]
        )
    assert any(output.outputs[0].weight_versions == [0, 1] for output in outputs)
    with pytest.raises(RuntimeError, match="paused"):
        llm.update_weights(str(checkpoint))


def test_real_model_update_weights_with_changed_tensors_changes_later_tokens(
    checkpoint: Path,
) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "model.safetensors"))
    changed = {
        "lm_head.weight": -weights["lm_head.weight"],
        "model.embed_tokens.weight": weights["model.embed_tokens.weight"] * 3.0,
    }
    prompts = REAL_PROMPTS[:3]
    expected = token_ids(real_generate(real_llm(checkpoint), prompts))
    llm = real_llm(checkpoint)
    gate = install_gate(llm, after_steps=5)
    seen: dict[str, Any] = {}

    def controller() -> None:
        pause_at_gate(llm, gate, "keep", clear_cache=False)
        seen["at_pause"] = progress(llm)
        llm.update_weights(changed)
        assert llm.reset_prefix_cache(
            reset_running_requests=True
        )  # the cached KV came from the old weights
        llm.resume_generation()

    outputs, _ = run_threads(lambda: real_generate(llm, prompts), controller)
    # The oracle for the tokens after the update: a fresh engine with the changed weights continuing each
    # request's prompt plus the tokens it had before the pause.
    updated = real_llm(checkpoint)
    updated.pause_generation(mode="keep")
    updated.update_weights(changed)
    updated.resume_generation()
    num_changed = 0
    for output, prompt, reference in zip(outputs, prompts, expected, strict=True):
        tokens = output.outputs[0].token_ids
        num_before = seen["at_pause"][output.request_id]
        assert 0 < num_before < REAL_MAX_TOKENS and tokens[:num_before] == reference[:num_before]
        continuation = (
            updated.generate(
                {"prompt_token_ids": prompt + reference[:num_before]},
                SamplingParams(
                    temperature=0.0, max_tokens=REAL_MAX_TOKENS - num_before, ignore_eos=True
                ),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .token_ids
        )
        assert tokens[num_before:] == continuation
        num_changed += tokens[num_before:] != reference[num_before:]
        assert output.outputs[0].weight_versions == [0, 1]
    assert num_changed == len(prompts)
    assert torch.equal(
        weights["lm_head.weight"],
        load_file(str(checkpoint / "model.safetensors"))["lm_head.weight"],
    )
