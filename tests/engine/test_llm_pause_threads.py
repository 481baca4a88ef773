"""The thread-safe LLM under pause / resume from other threads: one thread runs `generate` while others pause (every
mode), resume, pause concurrently and update weights. No caller may be stranded (every join has a timeout), every
result is exact (or, when an abort pause ended it, a prefix of the exact output); on a real tiny checkpoint a
pause(keep, clear_cache=True) + resume in the middle leaves greedy outputs unchanged, and weight updates show in
the outputs (`CompletionOutput.weight_versions`) and, for changed weights, in the tokens.

To land a pause at a chosen point of a generation, `LoopGate` stands in for the progress bar that
`LLM.generate` updates once per loop iteration outside the engine lock: after a given number of iterations it
signals the controlling thread and holds the generating thread until that thread's pause has begun (further
`Hold`s stop it at other points, e.g. right after the step that told the worker about a pause's preemptions).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, RequestOutput, SamplingParams
from kvflow.testing.hash_model import reference_tokens

JOIN_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------------- helpers
class Hold:
    """One point where the generating thread stops: when `predicate()` first holds after a loop iteration, it
    signals `reached` and waits until the controller calls `open()` (or, with `release_on_pause`, until a pause
    has begun: a pause on the async engine needs the generating thread to keep stepping)."""

    def __init__(
        self, predicate: Callable[[], bool], release_on_pause: Callable[[], bool] | None = None
    ) -> None:
        self.predicate = predicate
        self.release_on_pause = release_on_pause
        self.reached = threading.Event()
        self.opened = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        deadline = time.monotonic() + 10
        while not (
            self.opened.is_set() or (self.release_on_pause is not None and self.release_on_pause())
        ):
            assert time.monotonic() < deadline, (
                "the controller never released the generating thread"
            )
            time.sleep(0.001)

    def wait(self) -> None:
        """Controller side: block until the generating thread is held here."""
        assert self.reached.wait(JOIN_TIMEOUT_S), "the generation never reached the hold"

    def open(self) -> None:
        self.opened.set()


class LoopGate(Hold):
    """Replaces `tqdm` in kvflow.entrypoints.llm (see the module docstring); is itself the first hold (after
    `after_iterations` iterations, released once the controller's pause has begun), and takes more holds."""

    def __init__(self, after_iterations: int, is_paused: Callable[[], bool]) -> None:
        super().__init__(
            lambda: self.num_iterations == after_iterations, release_on_pause=is_paused
        )
        self.num_iterations = 0
        self.holds: list[Hold] = [self]

    def add_hold(self, predicate: Callable[[], bool]) -> Hold:
        hold = Hold(predicate)
        self.holds.append(hold)
        return hold

    def __call__(self, *args: Any, **kwargs: Any) -> LoopGate:
        return self

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        self.num_iterations += 1
        for hold in self.holds:
            if not hold.reached.is_set() and hold.predicate():
                hold.hold()


def install_gate(monkeypatch: pytest.MonkeyPatch, llm: LLM, after_iterations: int) -> LoopGate:
    gate = LoopGate(after_iterations, llm.engine_core.is_paused)
    monkeypatch.setattr("kvflow.entrypoints.llm.tqdm", gate)
    return gate


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
    with llm._lock:
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
    """Once the worker has heard the last finishes (one more step), nothing is left anywhere."""
    core = llm.engine_core
    scheduler = core.scheduler
    assert (
        not core.is_paused() and not scheduler.requests and not scheduler.has_unfinished_requests()
    )
    with llm._lock:
        for _ in range(3):
            if core.has_work():
                llm._step_locked()
    assert not core.has_work()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    slots = core.executor.worker.model_runner.slots
    assert len(slots.free_indices) == slots.max_num_reqs


SCHEDULING = {"sync": False, "async": True}


# ---------------------------------------------------------------------------------------------------- hash model
@pytest.mark.parametrize("clear_cache", [False, True])
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_keep_from_another_thread_freezes_generation_until_resume(
    monkeypatch: pytest.MonkeyPatch, scheduling: str, clear_cache: bool
) -> None:
    llm = hash_llm(async_scheduling=SCHEDULING[scheduling])
    prompts = prompts_of(6)
    gate = install_gate(monkeypatch, llm, after_iterations=6)
    seen: dict[str, Any] = {}

    def controller() -> None:
        gate.wait()
        llm.pause_generation(mode="keep", clear_cache=clear_cache)
        gate.open()
        assert llm.is_paused() and llm.engine_core.pause_effective()
        seen["at_pause"] = frozen = progress(llm)
        time.sleep(0.1)  # the generating thread keeps looping: nothing may move
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
    monkeypatch: pytest.MonkeyPatch, scheduling: str
) -> None:
    llm = hash_llm(async_scheduling=SCHEDULING[scheduling], max_num_seqs=3)
    prompts = prompts_of(7, seed=1)
    gate = install_gate(monkeypatch, llm, after_iterations=4)
    seen: dict[str, Any] = {}

    def controller() -> None:
        gate.wait()
        llm.pause_generation(mode="wait", clear_cache=False)
        gate.open()
        with llm._lock:
            requests = list(llm.engine_core.scheduler.requests.values())
            seen["held"] = len(requests)
            assert all(
                request.num_output_tokens == 0 and request.num_computed_tokens == 0
                for request in requests
            )
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
    monkeypatch: pytest.MonkeyPatch, scheduling: str
) -> None:
    llm = hash_llm(async_scheduling=SCHEDULING[scheduling])
    prompts, late_prompts = prompts_of(6, seed=2), prompts_of(3, seed=3)
    gate = install_gate(monkeypatch, llm, after_iterations=5)
    queued = threading.Event()
    late_started = threading.Event()

    def controller() -> None:
        gate.wait()
        llm.pause_generation(mode="abort")
        gate.open()
        assert llm.engine_core.pause_effective()
        late_started.set()
        deadline = time.monotonic() + 10
        while llm.engine_core.scheduler.get_num_unfinished_requests() < len(late_prompts):
            assert time.monotonic() < deadline, "the late requests were never queued"
            time.sleep(0.005)
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
    monkeypatch: pytest.MonkeyPatch, checkpoint: Path, scheduling: str
) -> None:
    expected = token_ids(
        real_generate(real_llm(checkpoint, async_scheduling=SCHEDULING[scheduling]))
    )
    llm = real_llm(checkpoint, async_scheduling=SCHEDULING[scheduling])
    gate = install_gate(monkeypatch, llm, after_iterations=6)
    seen: dict[str, Any] = {}

    def controller() -> None:
        gate.wait()
        llm.pause_generation(mode="keep", clear_cache=True)
        gate.open()
        seen["at_pause"] = progress(llm)
        with llm._lock:
            assert not llm.engine_core.scheduler.running  # preempted: they recompute after resume
        llm.resume_generation()

    outputs, _ = run_threads(lambda: real_generate(llm), controller)
    assert token_ids(outputs) == expected
    assert any(0 < count < REAL_MAX_TOKENS for count in seen["at_pause"].values()), seen
    assert llm.engine_core.scheduler.num_preemptions_total > 0
    check_engine_clean(llm)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_real_model_update_weights_with_the_same_checkpoint_keeps_outputs(
    monkeypatch: pytest.MonkeyPatch, checkpoint: Path, clear_cache: bool
) -> None:
    expected = token_ids(real_generate(real_llm(checkpoint)))
    llm = real_llm(checkpoint)
    with pytest.raises(RuntimeError, match="paused"):
        llm.update_weights(str(checkpoint))
    gate = install_gate(monkeypatch, llm, after_iterations=6)
    core = llm.engine_core
    # With clear_cache the pause preempts every request, which the worker hears in the generating thread's next
    # step: update the weights right after that step (no batch may be in flight then).
    reported = gate.add_hold(
        lambda: core.pause_effective() and not core.scheduler.has_pending_reports()
    )
    seen: dict[str, Any] = {}

    def controller() -> None:
        gate.wait()
        llm.pause_generation(mode="keep", clear_cache=clear_cache)
        gate.open()
        seen["at_pause"] = progress(llm)
        if clear_cache:
            reported.wait()
        seen["version"] = llm.update_weights(str(checkpoint))
        reported.open()
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
    monkeypatch: pytest.MonkeyPatch, checkpoint: Path
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
    gate = install_gate(monkeypatch, llm, after_iterations=5)
    seen: dict[str, Any] = {}

    def controller() -> None:
        gate.wait()
        llm.pause_generation(mode="keep", clear_cache=False)
        gate.open()
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
