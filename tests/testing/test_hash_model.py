"""The hash model oracle: its hash, its reference output, and agreement of the batched model with the reference."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.batch import BatchInputs
from kvflow.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import (
    BASE,
    DEFAULT_VOCAB_SIZE,
    MODULUS,
    MULTIPLIER,
    HashModel,
    hash_tokens,
    next_token,
    reference_tokens,
)
from kvflow.worker.model_runner import ModelRunner

token_lists = st.lists(st.integers(0, DEFAULT_VOCAB_SIZE - 1), min_size=1, max_size=40)


def polynomial_next_token(token_ids: list[int], vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """The documented formula, written out term by term."""
    length = len(token_ids)
    value = (
        sum(
            token % MODULUS * pow(BASE, length - 1 - i, MODULUS) % MODULUS
            for i, token in enumerate(token_ids)
        )
        % MODULUS
    )
    return (value * MULTIPLIER + length) % MODULUS % vocab_size


# ---------------------------------------------------------------------------------------------- the hash
@given(token_lists)
def test_next_token_matches_the_documented_formula(token_ids: list[int]) -> None:
    assert next_token(token_ids) == polynomial_next_token(token_ids)


@given(token_lists, st.integers(1, 20))
def test_reference_tokens_rehash_the_whole_sequence_each_step(
    prompt: list[int], max_tokens: int
) -> None:
    generated = reference_tokens(prompt, max_tokens)
    assert len(generated) == max_tokens
    for i, token in enumerate(generated):
        assert token == polynomial_next_token(prompt + generated[:i])
        assert 0 <= token < DEFAULT_VOCAB_SIZE


def test_reference_tokens_never_emit_the_default_eos() -> None:
    for seed in range(50):
        prompt = random.Random(seed).choices(range(DEFAULT_VOCAB_SIZE), k=8)
        assert DEFAULT_VOCAB_SIZE not in reference_tokens(prompt, 64)


def test_small_vocab_bounds_every_token() -> None:
    generated = reference_tokens([1, 2, 3], 200, vocab_size=7)
    assert set(generated) <= set(range(7))
    assert len(set(generated)) > 1


@given(token_lists.filter(lambda tokens: len(tokens) >= 2), st.data())
def test_hash_is_position_sensitive(token_ids: list[int], data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(token_ids) - 1))
    dropped = token_ids[:index] + token_ids[index + 1 :]
    duplicated = token_ids[: index + 1] + token_ids[index:]
    changed = token_ids.copy()
    changed[index] = (changed[index] + 1) % DEFAULT_VOCAB_SIZE
    variants = [dropped, duplicated, changed]
    if token_ids[index] != token_ids[(index + 1) % len(token_ids)]:
        swapped = token_ids.copy()
        other = (index + 1) % len(token_ids)
        swapped[index], swapped[other] = swapped[other], swapped[index]
        variants.append(swapped)
    for variant in variants:
        # Same-length variants differ in h (a collision has probability ~L / 2**31); others also in the length.
        assert (hash_tokens(variant), len(variant)) != (hash_tokens(token_ids), len(token_ids))


def test_fixed_examples_of_sensitivity_reach_the_sampled_token() -> None:
    prompt = [5, 6, 7, 8, 9]
    base = next_token(prompt)
    assert next_token([5, 6, 8, 7, 9]) != base  # reordered
    assert next_token([5, 6, 7, 7, 8, 9]) != base  # duplicated
    assert next_token([5, 6, 8, 9]) != base  # dropped
    assert next_token([5, 6, 7, 8, -1]) != base  # an unwritten slot


# ---------------------------------------------------------------------------------------------- the model
def batch_of(
    req_ids: list[str],
    input_ids: list[int],
    positions: list[int],
    slot_mapping: list[int],
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    sampled_req_indices: list[int],
    block_size: int,
) -> BatchInputs:
    ends = query_start_loc[1:]
    return BatchInputs(
        req_ids=req_ids,
        block_size=block_size,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        logits_indices=torch.tensor([ends[i] - 1 for i in sampled_req_indices], dtype=torch.int64),
        sampled_req_indices=torch.tensor(sampled_req_indices, dtype=torch.int64),
    )


def test_make_kv_cache_is_unwritten() -> None:
    cache = HashModel().make_kv_cache(5, 4)
    assert cache.dtype == torch.int64 and tuple(cache.shape) == (20,)
    assert bool((cache == -1).all())


def test_forward_writes_slots_then_reads_back_through_the_block_table() -> None:
    model = HashModel()
    cache = model.make_kv_cache(4, 2)
    # "x": tokens [7, 8, 9] in blocks [3, 1]; "y": a partial prefill of [4, 5] in block 0 (does not sample).
    batch = batch_of(
        ["x", "y"],
        [7, 8, 9, 4, 5],
        [0, 1, 2, 0, 1],
        [6, 7, 2, 0, 1],
        [0, 3, 5],
        [3, 2],
        [[3, 1], [0, 0]],
        sampled_req_indices=[0],
        block_size=2,
    )
    sampled = model.forward(batch, cache)
    assert cache.tolist() == [4, 5, 9, -1, -1, -1, 7, 8]
    assert sampled.dtype == torch.int64 and sampled.tolist() == [next_token([7, 8, 9])]


def test_forward_hashes_what_the_cache_holds_not_the_inputs() -> None:
    model = HashModel()
    cache = model.make_kv_cache(4, 2)
    cache[2:4] = torch.tensor([30, 31])  # block 1, written earlier
    # Decode position 4 of a sequence whose blocks are [1, 0, 2]: block 0 was never written.
    batch = batch_of(
        ["x"], [40], [4], [4], [0, 1], [5], [[1, 0, 2]], sampled_req_indices=[0], block_size=2
    )
    assert model.forward(batch, cache).tolist() == [next_token([30, 31, -1, -1, 40])]


def test_forward_with_nothing_to_sample_returns_empty() -> None:
    model = HashModel()
    cache = model.make_kv_cache(2, 2)
    batch = batch_of(
        ["x"], [1, 2], [0, 1], [0, 1], [0, 2], [2], [[0]], sampled_req_indices=[], block_size=2
    )
    sampled = model.forward(batch, cache)
    assert sampled.shape == (0,) and cache.tolist() == [1, 2, -1, -1]


def test_forward_respects_vocab_size() -> None:
    model = HashModel(vocab_size=5)
    cache = model.make_kv_cache(8, 4)
    prompts = [[i, i + 1, i + 2] for i in range(8)]
    batch = batch_of(
        [str(i) for i in range(8)],
        [t for p in prompts for t in p],
        [0, 1, 2] * 8,
        [4 * i + j for i in range(8) for j in range(3)],
        list(range(0, 25, 3)),
        [3] * 8,
        [[i] for i in range(8)],
        sampled_req_indices=list(range(8)),
        block_size=4,
    )
    sampled = model.forward(batch, cache).tolist()
    assert sampled == [reference_tokens(p, 1, vocab_size=5)[0] for p in prompts]
    assert all(0 <= token < 5 for token in sampled)


# ---------------------------------------------------------------------------------------------- batched vs reference
class MiniScheduler:
    """A tiny scheduler for the runner: random chunk sizes, random subsets per step, shuffled block ids.

    It never sends sampled tokens back: the worker must feed its own. Each step's plan is a real SchedulerOutput.
    """

    def __init__(
        self, prompts: list[list[int]], max_tokens: int, block_size: int, rng: random.Random
    ) -> None:
        self.rng = rng
        self.block_size = block_size
        self.max_tokens = max_tokens
        num_blocks = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
        self.free_blocks = list(range(num_blocks))
        rng.shuffle(self.free_blocks)
        self.num_blocks = num_blocks
        self.prompts = {str(i): prompt for i, prompt in enumerate(prompts)}
        self.num_tokens = {req_id: len(prompt) for req_id, prompt in self.prompts.items()}
        self.num_computed = dict.fromkeys(self.prompts, 0)
        self.blocks: dict[str, list[int]] = {}
        self.admitted: set[str] = set()
        self.outputs: dict[str, list[int]] = {req_id: [] for req_id in self.prompts}

    def unfinished(self) -> list[str]:
        return [req_id for req_id, out in self.outputs.items() if len(out) < self.max_tokens]

    def schedule(self) -> SchedulerOutput:
        candidates = self.unfinished()
        chosen = [r for r in candidates if self.rng.random() < 0.7] or candidates[:1]
        new_reqs, cached = [], CachedRequestData()
        scheduled: dict[str, int] = {}
        for req_id in chosen:
            remaining = self.num_tokens[req_id] - self.num_computed[req_id]
            num_new = self.rng.randint(1, remaining)
            new_block_ids = self._allocate(req_id, self.num_computed[req_id] + num_new)
            scheduled[req_id] = num_new
            if req_id in self.admitted:
                cached.req_ids.append(req_id)
                cached.new_token_ids.append([])
                cached.new_block_ids.append((new_block_ids,) if new_block_ids else None)
                cached.num_computed_tokens.append(self.num_computed[req_id])
                cached.num_output_tokens.append(len(self.outputs[req_id]))
            else:
                self.admitted.add(req_id)
                new_reqs.append(
                    NewRequestData(
                        req_id, self.prompts[req_id], SamplingParams(), (new_block_ids,), 0
                    )
                )
        return SchedulerOutput(new_reqs, cached, scheduled, sum(scheduled.values()))

    def _allocate(self, req_id: str, num_tokens: int) -> list[int]:
        blocks = self.blocks.setdefault(req_id, [])
        needed = -(-num_tokens // self.block_size) - len(blocks)
        new_block_ids = [self.free_blocks.pop() for _ in range(needed)]
        blocks.extend(new_block_ids)
        return new_block_ids

    def update(self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            self.num_computed[req_id] += num_new
            if sampled[req_id]:
                self.outputs[req_id].extend(sampled[req_id])
                self.num_tokens[req_id] += 1


@settings(max_examples=40, deadline=None)
@given(
    st.lists(token_lists, min_size=1, max_size=6),
    st.integers(1, 6),
    st.sampled_from([1, 2, 4, 16]),
    st.integers(0, 2**32 - 1),
)
def test_batched_runner_matches_reference(
    prompts: list[list[int]], max_tokens: int, block_size: int, seed: int
) -> None:
    scheduler = MiniScheduler(prompts, max_tokens, block_size, random.Random(seed))
    runner = ModelRunner(
        HashModel(),
        max_num_reqs=len(prompts),
        max_model_len=64,
        block_size=block_size,
        num_blocks=scheduler.num_blocks,
    )
    while scheduler.unfinished():
        scheduler_output = scheduler.schedule()
        output = runner.execute_model(scheduler_output)
        assert output.req_ids == list(scheduler_output.num_scheduled_tokens)
        scheduler.update(
            scheduler_output,
            {r: output.sampled_token_ids[output.req_id_to_index[r]] for r in output.req_ids},
        )
    for req_id, prompt in scheduler.prompts.items():
        assert scheduler.outputs[req_id] == reference_tokens(prompt, max_tokens)


@pytest.mark.parametrize("seed", range(5))
def test_batched_runner_matches_reference_for_long_prompts(seed: int) -> None:
    rng = random.Random(seed)
    prompts = [rng.choices(range(DEFAULT_VOCAB_SIZE), k=rng.randint(100, 400)) for _ in range(8)]
    scheduler = MiniScheduler(prompts, 8, 16, rng)
    runner = ModelRunner(
        HashModel(),
        max_num_reqs=8,
        max_model_len=512,
        block_size=16,
        num_blocks=scheduler.num_blocks,
    )
    while scheduler.unfinished():
        scheduler_output = scheduler.schedule()
        output = runner.execute_model(scheduler_output)
        scheduler.update(
            scheduler_output, dict(zip(output.req_ids, output.sampled_token_ids, strict=True))
        )
    assert [scheduler.outputs[str(i)] for i in range(8)] == [
        reference_tokens(p, 8) for p in prompts
    ]


def test_the_testing_package_re_exports_the_models_hash_model() -> None:
    """Tests outside this repository import the oracle from `kvflow.testing`; it is the model's own objects."""
    import kvflow.models.hash_model as model_module
    import kvflow.testing
    import kvflow.testing.hash_model as testing_module

    for name in testing_module.__all__:
        assert getattr(testing_module, name) is getattr(model_module, name)
    assert kvflow.testing.DEFAULT_EOS_TOKEN_ID == model_module.DEFAULT_EOS_TOKEN_ID == 50256
