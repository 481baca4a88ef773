"""Prompt logprobs in the model runners, on a real checkpoint against transformers' float32 log_softmax.

The runner adds logits rows for prompt positions only for requests that ask, after the sampled rows; a request
without prompt logprobs leaves `BatchInputs.logits_indices` at one row per sampling request.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.batch import BatchInputs
from kvflow.core.sched.output import (
    CachedRequestData,
    LogprobsLists,
    NewRequestData,
    SchedulerOutput,
)
from kvflow.models.loader import load_model
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import HashModel
from kvflow.testing.hf_checkpoints import hf_logits, load_hf_model, make_tiny_checkpoint
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.persistent_batch import PersistentBatchModelRunner

BLOCK_SIZE = 4
PROMPT = [5, 17, 42, 99, 7, 7, 130, 64, 250, 3, 11, 200, 31, 8, 77, 150, 60, 90, 12, 140]
OTHER_PROMPT = [9, 8, 7, 6, 5, 4]
TOLERANCE = 1e-4


class RecordingModel:
    """A real model that keeps every batch it ran, so tests can read the runner's logits indices."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.samples_own_tokens = False
        self.batches: list[BatchInputs] = []

    def make_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        return self.model.make_kv_cache(num_blocks, block_size)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_cache_bytes_per_block(block_size)

    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        self.batches.append(batch)
        return self.model.forward(batch, kv_cache)

    def load_weights(self, weights, strict: bool = True) -> None:  # type: ignore[no-untyped-def]
        self.model.load_weights(weights, strict)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.Tensor:
    """transformers' float32 log_softmax at every position of PROMPT."""
    return hf_logits(checkpoint, PROMPT, load_hf_model(checkpoint)).log_softmax(dim=-1)


def make_runner(checkpoint: Path, persistent: bool = False) -> tuple[ModelRunner, RecordingModel]:
    model = RecordingModel(load_model(checkpoint, dtype="float32"))
    runner_class = PersistentBatchModelRunner if persistent else ModelRunner
    runner = runner_class(
        model,  # type: ignore[arg-type]
        max_num_reqs=4,
        max_model_len=64,
        block_size=BLOCK_SIZE,
        num_blocks=64,
    )
    return runner, model


def new(
    req_id: str,
    prompt: list[int],
    block_ids: list[int],
    prompt_logprobs: int | None = None,
    prefill_token_ids: list[int] | None = None,
) -> NewRequestData:
    params = SamplingParams(temperature=0.0, prompt_logprobs=prompt_logprobs)
    return NewRequestData(req_id, prompt, params, (block_ids,), 0, prefill_token_ids)


def cached(
    *entries: tuple[str, int], resumed: dict[str, list[int]] | None = None
) -> CachedRequestData:
    """Entries are (req_id, num_computed_tokens); `resumed` maps resumed ids to their new block ids."""
    resumed = resumed or {}
    return CachedRequestData(
        req_ids=[req_id for req_id, _ in entries],
        resumed_req_ids=set(resumed),
        new_token_ids=[[] for _ in entries],
        new_block_ids=[(resumed[req_id],) if req_id in resumed else None for req_id, _ in entries],
        num_computed_tokens=[num_computed for _, num_computed in entries],
        num_output_tokens=[0 for _ in entries],
    )


def step(
    scheduled: dict[str, int],
    new_reqs: list[NewRequestData] | None = None,
    cached_reqs: CachedRequestData | None = None,
    preempted: set[str] | None = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs or [],
        scheduled_cached_reqs=cached_reqs or CachedRequestData(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        preempted_req_ids=preempted or set(),
    )


def assert_rows_match(
    rows: LogprobsLists, reference: torch.Tensor, first_token: int, num_rows: int, k: int
) -> None:
    """Rows for PROMPT tokens first_token .. first_token + num_rows - 1: the actual token, then the top k."""
    assert rows.start_index == first_token and rows.num_rows == num_rows
    for j in range(num_rows):
        token_index = first_token + j
        expected = reference[token_index - 1]
        actual_token = PROMPT[token_index]
        assert rows.logprob_token_ids[j][0] == actual_token
        assert rows.logprobs[j][0] == pytest.approx(expected[actual_token].item(), abs=TOLERANCE)
        assert rows.sampled_token_ranks[j] == int((expected > expected[actual_token]).sum()) + 1
        top = expected.topk(k)
        assert rows.logprob_token_ids[j][1:] == top.indices.tolist()
        assert rows.logprobs[j][1:] == pytest.approx(top.values.tolist(), abs=TOLERANCE)


def only_sampled_rows(batch: BatchInputs) -> bool:
    return batch.logits_indices.shape[0] == batch.sampled_req_indices.shape[0]


def test_requests_without_prompt_logprobs_add_no_logits_rows(checkpoint: Path) -> None:
    runner, model = make_runner(checkpoint)
    blocks = list(range(6))
    first = runner.execute_model(step({"a": 8}, new_reqs=[new("a", PROMPT, blocks)]))
    second = runner.execute_model(step({"a": 12}, cached_reqs=cached(("a", 8))))
    third = runner.execute_model(step({"a": 1}, cached_reqs=cached(("a", 20))))
    assert [only_sampled_rows(batch) for batch in model.batches] == [True, True, True]
    assert [batch.logits_indices.shape[0] for batch in model.batches] == [0, 1, 1]
    assert all(out.prompt_logprobs_dict is None for out in (first, second, third))
    assert runner.prompt_logprob_reqs == {}


def test_chunked_prompt_rows_follow_the_sampled_rows_and_match_transformers(
    checkpoint: Path, reference: torch.Tensor
) -> None:
    runner, model = make_runner(checkpoint)
    # "b" decodes alongside: its sampled row comes first, "a"'s prompt rows after it.
    runner.execute_model(step({"b": 6}, new_reqs=[new("b", OTHER_PROMPT, [10, 11])]))
    first = runner.execute_model(
        step(
            {"b": 1, "a": 8},
            new_reqs=[new("a", PROMPT, list(range(6)), prompt_logprobs=3)],
            cached_reqs=cached(("b", 6)),
        )
    )
    batch = model.batches[-1]
    # b's token is flat index 0 (sampled); a's positions 0..7 are flat 1..8 (prompt rows for tokens 1..8).
    assert batch.logits_indices.tolist() == [0, *range(1, 9)]
    assert first.prompt_logprobs_dict is not None and set(first.prompt_logprobs_dict) == {"a"}
    assert (
        first.sampled_token_ids[first.req_id_to_index["a"]] == []
    )  # a partial prefill samples nothing
    assert_rows_match(first.prompt_logprobs_dict["a"], reference, 1, 8, k=3)

    second = runner.execute_model(step({"a": 12}, cached_reqs=cached(("a", 8))))
    # Positions 8..18 give tokens 9..19; position 19 (the last) samples the first output.
    assert model.batches[-1].logits_indices.tolist() == [11, *range(11)]
    assert second.prompt_logprobs_dict is not None
    assert_rows_match(second.prompt_logprobs_dict["a"], reference, 9, 11, k=3)
    [sampled] = second.sampled_token_ids[second.req_id_to_index["a"]]
    assert sampled == int(reference[19].argmax())
    assert runner.prompt_logprob_reqs == {}

    third = runner.execute_model(step({"a": 1}, cached_reqs=cached(("a", 20))))
    assert only_sampled_rows(model.batches[-1]) and third.prompt_logprobs_dict is None


def test_chunk_ending_at_the_last_prompt_position_leaves_nothing_for_the_next(
    checkpoint: Path, reference: torch.Tensor
) -> None:
    runner, model = make_runner(checkpoint)
    first = runner.execute_model(
        step({"a": 19}, new_reqs=[new("a", PROMPT, list(range(6)), prompt_logprobs=0)])
    )
    assert first.prompt_logprobs_dict is not None
    assert_rows_match(first.prompt_logprobs_dict["a"], reference, 1, 19, k=0)
    assert runner.prompt_logprob_reqs == {}
    last = runner.execute_model(step({"a": 1}, cached_reqs=cached(("a", 19))))
    assert only_sampled_rows(model.batches[-1]) and last.prompt_logprobs_dict is None


def test_slot_resume_with_outputs_does_not_recompute_prompt_logprobs(checkpoint: Path) -> None:
    runner, model = make_runner(checkpoint)
    resumed = new("a", PROMPT, list(range(6)), prompt_logprobs=2, prefill_token_ids=[*PROMPT, 33])
    output = runner.execute_model(step({"a": 21}, new_reqs=[resumed]))
    assert only_sampled_rows(model.batches[-1]) and output.prompt_logprobs_dict is None


def test_slot_resume_before_the_first_output_recomputes_from_token_one(
    checkpoint: Path, reference: torch.Tensor
) -> None:
    runner, _ = make_runner(checkpoint)
    runner.execute_model(step({"a": 8}, new_reqs=[new("a", PROMPT, list(range(5)), 1)]))
    resumed = new("a", PROMPT, [20, 21, 22], prompt_logprobs=1, prefill_token_ids=list(PROMPT))
    output = runner.execute_model(step({"a": 10}, new_reqs=[resumed], preempted={"a"}))
    assert output.prompt_logprobs_dict is not None
    assert_rows_match(output.prompt_logprobs_dict["a"], reference, 1, 10, k=1)


def test_persistent_batch_resume_recomputes_rows_of_an_unfinished_prompt(
    checkpoint: Path, reference: torch.Tensor
) -> None:
    runner, _ = make_runner(checkpoint, persistent=True)
    runner.execute_model(step({"a": 8}, new_reqs=[new("a", PROMPT, list(range(5)), 2)]))
    runner.execute_model(step({}, preempted={"a"}))
    assert "a" in runner.parked and runner.prompt_logprob_reqs == {}
    output = runner.execute_model(
        step({"a": 20}, cached_reqs=cached(("a", 0), resumed={"a": [30, 31, 32, 33, 34]}))
    )
    assert output.prompt_logprobs_dict is not None
    assert_rows_match(output.prompt_logprobs_dict["a"], reference, 1, 19, k=2)


def test_a_model_without_logits_refuses_prompt_logprobs() -> None:
    runner = ModelRunner(
        HashModel(), max_num_reqs=2, max_model_len=32, block_size=BLOCK_SIZE, num_blocks=16
    )
    with pytest.raises(ValueError, match=r"prompt_logprobs.*no logits"):
        runner.execute_model(step({"a": 4}, new_reqs=[new("a", [1, 2, 3, 4], [0], 1)]))
