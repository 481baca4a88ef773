"""ModelRunner on the hash model: slot protocol, persistent-batch protocol, batch tensors, and the oracle."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from kvflow.batch import BatchInputs
from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvflow.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvflow.models.hash_model import HashLogitsModel
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import HashModel, next_token, reference_tokens
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.persistent_batch import PersistentBatchModelRunner
from kvflow.worker.worker import Worker, get_model_runner_class

BLOCK_SIZE = 4


class RecordingHashModel(HashModel):
    """The hash model, keeping every batch it ran so tests can inspect the runner's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[BatchInputs] = []

    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        self.batches.append(batch)
        return super().forward(batch, kv_cache)


def make_runner(
    max_num_reqs: int = 4,
    max_model_len: int = 64,
    num_blocks: int = 64,
    use_v2_model_runner: bool = True,
) -> ModelRunner:
    """The slot runner, or with `use_v2_model_runner=False` the persistent-batch runner, on the hash model."""
    return get_model_runner_class(use_v2_model_runner)(
        RecordingHashModel(),
        max_num_reqs=max_num_reqs,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
    )


def make_persistent_runner(max_num_reqs: int = 4) -> PersistentBatchModelRunner:
    runner = make_runner(max_num_reqs=max_num_reqs, use_v2_model_runner=False)
    assert isinstance(runner, PersistentBatchModelRunner)
    return runner


def new(
    req_id: str,
    prompt: list[int],
    block_ids: list[int],
    num_computed_tokens: int = 0,
    prefill_token_ids: list[int] | None = None,
) -> NewRequestData:
    return NewRequestData(
        req_id, prompt, SamplingParams(), (block_ids,), num_computed_tokens, prefill_token_ids
    )


def cached(
    *entries: tuple[str, int, list[int] | None, list[int]],
    resumed: Iterable[str] = (),
    all_token_ids: dict[str, list[int]] | None = None,
) -> CachedRequestData:
    """Entries are (req_id, num_computed_tokens, new block ids or None, new token ids)."""
    return CachedRequestData(
        req_ids=[entry[0] for entry in entries],
        resumed_req_ids=set(resumed),
        new_token_ids=[entry[3] for entry in entries],
        all_token_ids=all_token_ids or {},
        new_block_ids=[None if entry[2] is None else (entry[2],) for entry in entries],
        num_computed_tokens=[entry[1] for entry in entries],
        num_output_tokens=[0 for _ in entries],
    )


def step(
    scheduled: dict[str, int],
    new_reqs: Iterable[NewRequestData] = (),
    cached_reqs: CachedRequestData | None = None,
    finished: Iterable[str] = (),
    preempted: Iterable[str] = (),
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=cached_reqs or CachedRequestData(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def decode(
    runner: ModelRunner,
    req_id: str,
    num_computed_tokens: int,
    new_block_ids: list[int] | None = None,
) -> int:
    """One decode step for one request; returns its sampled token."""
    output = runner.execute_model(
        step({req_id: 1}, cached_reqs=cached((req_id, num_computed_tokens, new_block_ids, [])))
    )
    (token,) = output.sampled_token_ids[output.req_id_to_index[req_id]]
    return token


def last_batch(runner: ModelRunner) -> BatchInputs:
    model = runner.model
    assert isinstance(model, RecordingHashModel)
    return model.batches[-1]


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens: blocks of 4 -> 3 blocks


# ---------------------------------------------------------------------------------------------- batch tensors
def test_mixed_batch_tensors() -> None:
    runner = make_runner()
    # "d" is decoding (6 prompt tokens, computed), "p" a first prefill chunk, "q" a whole prompt.
    runner.execute_model(step({"d": 6}, [new("d", [1, 2, 3, 4, 5, 6], [9, 2])]))
    d_token = runner.slots.get_token_ids("d")[-1]
    output = runner.execute_model(
        step(
            {"d": 1, "p": 5, "q": 3},
            [new("p", PROMPT, [5, 7]), new("q", [40, 41, 42], [3])],
            cached(("d", 6, None, [])),
        )
    )
    batch = last_batch(runner)
    assert batch.req_ids == ["d", "p", "q"]
    assert batch.input_ids.tolist() == [d_token, 11, 12, 13, 14, 15, 40, 41, 42]
    assert batch.positions.tolist() == [6, 0, 1, 2, 3, 4, 0, 1, 2]
    # d: pos 6 -> block 2 (table [9, 2]), offset 2 -> 10; p: blocks 5, 7; q: block 3.
    assert batch.slot_mapping.tolist() == [10, 20, 21, 22, 23, 28, 12, 13, 14]
    assert batch.query_start_loc.tolist() == [0, 1, 6, 9]
    assert batch.seq_lens.tolist() == [7, 5, 3]
    assert batch.block_tables.tolist() == [[9, 2], [5, 7], [3, 0]]
    assert batch.logits_indices.tolist() == [0, 8]
    assert batch.sampled_req_indices.tolist() == [0, 2]
    assert output.req_ids == ["d", "p", "q"]
    assert output.req_id_to_index == {"d": 0, "p": 1, "q": 2}
    assert output.sampled_token_ids[1] == []  # partial prefill samples nothing
    assert output.sampled_token_ids[0] == [reference_tokens([1, 2, 3, 4, 5, 6], 2)[1]]
    assert output.sampled_token_ids[2] == reference_tokens([40, 41, 42], 1)
    assert runner.slots.get_token_ids("p") == PROMPT  # nothing appended to a partial prefill
    assert runner.slots.num_computed_tokens[runner.slots.req_id_to_index["p"]] == 5


def test_block_table_padding_hides_a_previous_holders_blocks() -> None:
    runner = make_runner(max_num_reqs=2)
    runner.execute_model(step({"a": 10}, [new("a", PROMPT, [6, 7, 8])]))
    # "b" reuses slot 0 (which still holds a's stale table [6, 7, 8]) next to a 3-block request.
    output = runner.execute_model(
        step({"b": 1, "c": 10}, [new("b", [5], [3]), new("c", PROMPT, [4, 2, 1])], finished={"a"})
    )
    assert runner.slots.req_id_to_index["b"] == 0
    assert last_batch(runner).block_tables.tolist() == [[3, 0, 0], [4, 2, 1]]
    assert output.sampled_token_ids == [reference_tokens([5], 1), reference_tokens(PROMPT, 1)]


# ---------------------------------------------------------------------------------------------- oracle
def generate_one_shot(prompt: list[int], num_tokens: int, block_ids: list[int]) -> list[int]:
    runner = make_runner()
    output = runner.execute_model(step({"a": len(prompt)}, [new("a", prompt, block_ids)]))
    tokens = output.sampled_token_ids[0]
    for i in range(num_tokens - 1):
        tokens.append(decode(runner, "a", len(prompt) + i))
    return tokens


def test_one_shot_prefill_and_decode_match_reference() -> None:
    # 10 prompt + 5 outputs: position 14 fits the 4th block only after decode 2 (pos 12) adds it.
    runner = make_runner()
    output = runner.execute_model(step({"a": 10}, [new("a", PROMPT, [3, 1, 8])]))
    tokens = output.sampled_token_ids[0]
    tokens.append(decode(runner, "a", 10))
    tokens.append(decode(runner, "a", 11))
    tokens.append(decode(runner, "a", 12, new_block_ids=[2]))
    tokens.append(decode(runner, "a", 13))
    assert tokens == reference_tokens(PROMPT, 5)
    assert runner.slots.get_token_ids("a") == PROMPT + tokens


def test_greedy_rows_leave_the_full_sampling_path_only_once_min_tokens_is_met() -> None:
    """A batch of plain greedy rows skips the sampling metadata (`samples_argmax_only`); a row still below its
    min_tokens keeps the whole batch on the full path, where its EOS is banned. Both rows must decode as the rule
    computed without the engine: the banned EOS moves to the next token, then plain greedy argmax."""
    model = HashLogitsModel()
    eos = reference_tokens(PROMPT, 1)[
        0
    ]  # the plain greedy first token is the EOS: min_tokens bans it
    runner = ModelRunner(
        model,
        max_num_reqs=2,
        max_model_len=64,
        block_size=BLOCK_SIZE,
        num_blocks=64,
        eos_token_id=eos,
    )
    plain = NewRequestData("plain", PROMPT, SamplingParams(temperature=0), ([0, 1, 2, 3],), 0)
    banned = NewRequestData(
        "min", PROMPT, SamplingParams(temperature=0, min_tokens=2), ([4, 5, 6, 7],), 0
    )
    output = runner.execute_model(step({"plain": 10, "min": 10}, [plain, banned]))
    tokens = {
        req_id: list(output.sampled_token_ids[output.req_id_to_index[req_id]])
        for req_id in ("plain", "min")
    }
    for i in range(4):
        output = runner.execute_model(
            step(
                {"plain": 1, "min": 1},
                cached_reqs=cached(("plain", 10 + i, None, []), ("min", 10 + i, None, [])),
            )
        )
        for req_id in tokens:
            tokens[req_id] += output.sampled_token_ids[output.req_id_to_index[req_id]]
    expected: list[int] = []
    for _ in range(5):
        token = next_token(PROMPT + expected, model.vocab_size)
        if len(expected) < 2 and token == eos:
            token = (token + 1) % model.vocab_size
        expected.append(token)
    assert tokens["plain"] == reference_tokens(PROMPT, 5) and tokens["plain"][0] == eos
    assert tokens["min"] == expected and expected[0] != eos


def test_chunked_prefill_matches_one_shot_and_reference() -> None:
    runner = make_runner()
    first = runner.execute_model(step({"a": 4}, [new("a", PROMPT, [6])]))
    assert first.sampled_token_ids == [[]]
    second = runner.execute_model(step({"a": 6}, cached_reqs=cached(("a", 4, [0, 5], []))))
    tokens = second.sampled_token_ids[0] + [decode(runner, "a", 10), decode(runner, "a", 11)]
    assert tokens == generate_one_shot(PROMPT, 3, [6, 0, 5]) == reference_tokens(PROMPT, 3)


def test_prefix_hit_reads_blocks_written_by_another_request() -> None:
    runner = make_runner()
    runner.execute_model(step({"a": 10}, [new("a", PROMPT, [2, 3, 4])]))
    other = [*PROMPT[:8], 99, 98, 97]  # shares blocks 2 and 3 (8 tokens) with "a"
    output = runner.execute_model(
        step({"b": 3}, [new("b", other, [2, 3, 5], num_computed_tokens=8)])
    )
    assert last_batch(runner).input_ids.tolist() == [99, 98, 97]
    assert output.sampled_token_ids[0] == reference_tokens(other, 1)


@pytest.mark.parametrize("wrong_block_ids", [[2, 5, 6], [3, 2, 6], [9, 3, 6]])
def test_wrong_prefix_block_changes_the_output(wrong_block_ids: list[int]) -> None:
    runner = make_runner()
    runner.execute_model(
        step({"a": 10}, [new("a", PROMPT, [2, 3, 4])])
    )  # writes blocks 2, 3 (and 4)
    other = [*PROMPT[:8], 99, 98, 97]
    output = runner.execute_model(
        step({"b": 3}, [new("b", other, wrong_block_ids, num_computed_tokens=8)])
    )
    assert output.sampled_token_ids[0] != reference_tokens(other, 1)


def test_skipped_token_changes_the_output() -> None:
    runner = make_runner()
    runner.execute_model(step({"a": 4}, [new("a", PROMPT, [6, 0, 5])]))
    # A scheduler that loses a token: the second chunk starts at 5, so position 4 is never written.
    output = runner.execute_model(step({"a": 5}, cached_reqs=cached(("a", 5, None, []))))
    assert output.sampled_token_ids[0] != reference_tokens(PROMPT, 1)


def test_duplicated_token_changes_the_output() -> None:
    runner = make_runner()
    duplicated = PROMPT[:5] + PROMPT[4:]
    output = runner.execute_model(
        step({"a": 11}, [new("a", PROMPT, [1, 2, 3], prefill_token_ids=duplicated)])
    )
    assert output.sampled_token_ids[0] == reference_tokens(duplicated, 1)
    assert output.sampled_token_ids[0] != reference_tokens(PROMPT, 1)


# ---------------------------------------------------------------------------------------------- slot protocol
def test_slots_are_taken_freed_and_reused() -> None:
    runner = make_runner(max_num_reqs=2)
    runner.execute_model(step({"a": 2, "b": 2}, [new("a", [1, 2], [0]), new("b", [3, 4], [1])]))
    assert runner.slots.req_id_to_index == {"a": 0, "b": 1}
    with pytest.raises(AssertionError, match="No free indices"):
        runner.execute_model(step({"c": 1}, [new("c", [5], [2])]))
    assert "c" not in runner.slots and runner.slots.num_free == 0
    output = runner.execute_model(step({"c": 1}, [new("c", [5], [2])], finished={"a"}))
    assert runner.slots.req_id_to_index == {"b": 1, "c": 0}
    assert output.sampled_token_ids == [reference_tokens([5], 1)]


def test_same_id_add_replaces_the_old_slot() -> None:
    runner = make_runner(max_num_reqs=2)
    runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    output = runner.execute_model(step({"a": 3}, [new("a", [7, 8, 9], [4])]))
    assert runner.slots.num_free == 1
    assert runner.slots.get_token_ids("a") == [7, 8, 9] + output.sampled_token_ids[0]
    assert output.sampled_token_ids[0] == reference_tokens([7, 8, 9], 1)


def test_finished_and_re_added_in_the_same_output() -> None:
    runner = make_runner(max_num_reqs=1)
    runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    output = runner.execute_model(step({"a": 3}, [new("a", [7, 8, 9], [4])], finished={"a"}))
    assert output.sampled_token_ids == [reference_tokens([7, 8, 9], 1)]
    assert runner.slots.req_id_to_index == {"a": 0}


def test_empty_output_still_releases() -> None:
    runner = make_runner(max_num_reqs=2)
    runner.execute_model(step({"a": 2, "b": 2}, [new("a", [1, 2], [0]), new("b", [3, 4], [1])]))
    output = runner.execute_model(step({}, finished={"a"}, preempted={"b"}))
    assert (output.req_ids, output.req_id_to_index, output.sampled_token_ids) == ([], {}, [])
    assert runner.slots.num_free == 2 and not hasattr(runner, "parked")


def test_slot_protocol_resume_as_new_request_continues_the_reference() -> None:
    runner = make_runner(max_num_reqs=1)
    output = runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    generated = output.sampled_token_ids[0] + [decode(runner, "a", 10)]
    runner.execute_model(step({}, preempted={"a"}))
    assert runner.slots.num_free == 1 and not hasattr(runner, "parked")
    prefill = PROMPT + generated  # the last sampled token was never fed: all 12 are recomputed
    output = runner.execute_model(
        step({"a": 12}, [new("a", PROMPT, [7, 5, 6], prefill_token_ids=prefill)])
    )
    generated += output.sampled_token_ids[0]
    generated.append(decode(runner, "a", 12, new_block_ids=[9]))
    assert generated == reference_tokens(PROMPT, 4)


def test_cached_request_without_a_slot_is_named() -> None:
    runner = make_runner()
    with pytest.raises(AssertionError, match="'ghost' holds no worker slot"):
        runner.execute_model(step({"ghost": 1}, cached_reqs=cached(("ghost", 0, None, []))))


def test_scheduling_past_known_tokens_is_refused() -> None:
    runner = make_runner()
    runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    with pytest.raises(AssertionError, match=r"known tokens: \['a'\]"):
        runner.execute_model(step({"a": 2}, cached_reqs=cached(("a", 10, None, []))))


def test_scheduling_without_blocks_is_refused() -> None:
    runner = make_runner()
    with pytest.raises(AssertionError, match=r"without KV blocks: \['a'\]"):
        runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2])]))


def test_token_sampled_at_max_model_len_is_reported_not_stored() -> None:
    runner = make_runner(max_model_len=10)
    output = runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    assert output.sampled_token_ids == [reference_tokens(PROMPT, 1)]
    assert runner.slots.get_token_ids("a") == PROMPT


@pytest.mark.parametrize(
    "persistent_batch_data",
    [{"resumed": {"a"}}, {"all_token_ids": {"a": PROMPT}}],
    ids=["resumed_req_ids", "all_token_ids"],
)
def test_slot_runner_refuses_persistent_batch_data(persistent_batch_data: dict) -> None:
    runner = make_runner()
    runner.execute_model(step({"a": 4}, [new("a", PROMPT, [1])]))
    cached_reqs = cached(("a", 4, [2, 3], []), **persistent_batch_data)
    with pytest.raises(AssertionError, match="slot runner got persistent-batch data"):
        runner.execute_model(step({"a": 6}, cached_reqs=cached_reqs))


# ---------------------------------------------------------------------------------------------- streaming
def test_streaming_chunk_truncates_the_unfed_token_then_extends() -> None:
    runner = make_runner()
    output = runner.execute_model(step({"s": 6}, [new("s", PROMPT[:6], [1, 2])]))
    first = output.sampled_token_ids[0]
    second = decode(runner, "s", 6)
    assert runner.slots.get_token_ids("s") == PROMPT[:6] + first + [second]
    # The session pauses; its next chunk drops `second` (never fed) and appends [50, 51, 52].
    chunk = [50, 51, 52]
    output = runner.execute_model(step({"s": 3}, cached_reqs=cached(("s", 7, [3], chunk))))
    assert last_batch(runner).input_ids.tolist() == chunk
    assert last_batch(runner).positions.tolist() == [7, 8, 9]
    session_prompt = PROMPT[:6] + first + chunk
    assert output.sampled_token_ids[0] == reference_tokens(session_prompt, 1)
    assert decode(runner, "s", 10) == reference_tokens(session_prompt, 2)[1]


# ---------------------------------------------------------------------------------------------- persistent batch
def test_persistent_batch_preempted_request_keeps_state_and_resumes() -> None:
    runner = make_persistent_runner(max_num_reqs=1)
    output = runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    generated = output.sampled_token_ids[0] + [decode(runner, "a", 10)]
    runner.execute_model(step({}, preempted={"a"}))
    assert "a" not in runner.slots and runner.slots.num_free == 1
    assert runner.parked["a"].token_ids == PROMPT + generated
    # While "a" is out, "b" uses the only slot and overwrites blocks 1..3.
    runner.execute_model(step({"b": 12}, [new("b", list(range(12)), [1, 2, 3])]))
    runner.execute_model(step({}, finished={"b"}))
    output = runner.execute_model(
        step(
            {"a": 12},
            cached_reqs=cached(
                ("a", 0, [6, 4, 8], []), resumed={"a"}, all_token_ids={"a": PROMPT + generated}
            ),
        )
    )
    assert last_batch(runner).block_tables.tolist() == [[6, 4, 8]]
    generated += output.sampled_token_ids[0]
    generated.append(decode(runner, "a", 12, new_block_ids=[0]))
    assert generated == reference_tokens(PROMPT, 4)
    assert not runner.parked


def test_persistent_batch_resume_without_all_token_ids_uses_kept_tokens() -> None:
    runner = make_persistent_runner()
    output = runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    generated = output.sampled_token_ids[0]
    runner.execute_model(step({}, preempted={"a"}))
    output = runner.execute_model(
        step({"a": 11}, cached_reqs=cached(("a", 0, [7, 8, 9], []), resumed={"a"}))
    )
    assert output.sampled_token_ids[0] == reference_tokens(PROMPT, 2)[1:]
    assert generated == reference_tokens(PROMPT, 1)


def test_persistent_batch_preempted_request_cannot_run_unresumed() -> None:
    runner = make_persistent_runner()
    runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    runner.execute_model(step({}, preempted={"a"}))
    with pytest.raises(AssertionError, match="without being resumed"):
        runner.execute_model(step({"a": 1}, cached_reqs=cached(("a", 10, None, []))))


def test_persistent_batch_finished_drops_parked_state() -> None:
    runner = make_persistent_runner()
    runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    runner.execute_model(step({}, preempted={"a"}))
    runner.execute_model(step({}, finished={"a"}))
    assert not runner.parked and runner.slots.num_free == 4


def test_persistent_batch_resumed_held_request_replaces_blocks() -> None:
    # A resumed id the worker still holds in a slot (never parked) gets a replacement block table.
    runner = make_persistent_runner()
    runner.execute_model(step({"a": 4}, [new("a", PROMPT, [1])]))
    output = runner.execute_model(
        step({"a": 10}, cached_reqs=cached(("a", 0, [5, 6, 7], []), resumed={"a"}))
    )
    assert last_batch(runner).slot_mapping.tolist()[:4] == [20, 21, 22, 23]
    assert output.sampled_token_ids[0] == reference_tokens(PROMPT, 1)


def test_persistent_batch_all_token_ids_replace_a_stale_copy() -> None:
    runner = make_persistent_runner()
    output = runner.execute_model(step({"a": 10}, [new("a", PROMPT, [1, 2, 3])]))
    # The scheduler's view differs from the worker's after the first output: its copy wins.
    scheduler_view = [*PROMPT, *output.sampled_token_ids[0], 777]
    output = runner.execute_model(
        step({"a": 2}, cached_reqs=cached(("a", 10, None, []), all_token_ids={"a": scheduler_view}))
    )
    assert last_batch(runner).input_ids.tolist() == scheduler_view[10:]
    assert output.sampled_token_ids[0] == reference_tokens(scheduler_view, 1)


# ---------------------------------------------------------------------------------------------- worker
def test_worker_runs_the_hash_model_from_config() -> None:
    config = EngineConfig(
        model_config=ModelConfig(model="hash"),
        cache_config=CacheConfig(block_size=4, num_kv_blocks=16),
        scheduler_config=SchedulerConfig(max_num_seqs=3, max_model_len=32),
    )
    worker = Worker(config)
    assert worker.num_kv_blocks == 16
    assert worker.model_runner.slots.max_num_reqs == 3
    assert tuple(worker.model_runner.kv_cache.shape) == (64,)
    output = worker.execute_model(step({"a": 10}, [new("a", PROMPT, [3, 4, 5])]))
    assert output.sampled_token_ids == [reference_tokens(PROMPT, 1)]
    assert next_token(PROMPT) == output.sampled_token_ids[0][0]
    assert type(worker.model_runner) is ModelRunner
    persistent = EngineConfig(
        model_config=ModelConfig(model="hash"),
        cache_config=CacheConfig(num_kv_blocks=2),
        scheduler_config=SchedulerConfig(use_v2_model_runner=False),
    )
    assert isinstance(Worker(persistent).model_runner, PersistentBatchModelRunner)


def test_worker_sizes_the_kv_cache_from_memory() -> None:
    """kv_cache_memory_bytes buys whole blocks; without it, a fraction of free memory capped at full slots."""
    by_bytes = EngineConfig(
        model_config=ModelConfig(model="hash"),
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=32 * 10 + 31),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_model_len=32),
    )
    assert Worker(by_bytes).num_kv_blocks == 10  # the hash model stores 8 bytes per token slot
    capped = EngineConfig(
        model_config=ModelConfig(model="hash"),
        cache_config=CacheConfig(block_size=4),
        scheduler_config=SchedulerConfig(max_num_seqs=2, max_model_len=32),
    )
    assert Worker(capped).num_kv_blocks == 2 * 8
    too_small = EngineConfig(
        model_config=ModelConfig(model="hash"),
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=31),
    )
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=31 holds no KV block"):
        Worker(too_small)


def test_worker_refuses_a_weight_update_for_the_hash_model(tmp_path: Path) -> None:
    worker = Worker(
        EngineConfig(
            model_config=ModelConfig(model="hash"), cache_config=CacheConfig(num_kv_blocks=2)
        )
    )
    for weights in (str(tmp_path), {"model.embed_tokens.weight": torch.zeros(1)}):
        with pytest.raises(ValueError, match="the hash test model has no weights to update"):
            worker.update_weights(weights)


def test_worker_refuses_a_missing_checkpoint() -> None:
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        Worker(EngineConfig(model_config=ModelConfig(model="/no/such/checkpoint")))
