"""The typed proposer interface and `SpecDecodeRunner`, on hand-made slots (no model).

Every registered proposer is a `Proposer`; lookup proposers cost no KV bytes and draft per slot through
`propose_batch`; `write` pads placeholder drafts and plans the verification rows as `SpecStep` documents;
`accept` keeps the point-mass prefix and commits it; `propose` catches up every row but failed ones and obeys
`disable_by_batch_size`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvflow.config import SpeculativeConfig
from kvflow.core.sched.output import DRAFT_PLACEHOLDER
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode import SPEC_PROPOSERS
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.spec_decode.proposer import DraftBatch, LookupProposer, Proposal, Proposer
from kvflow.spec_decode.runner import SpecDecodeRunner, SpecStep
from kvflow.testing.spec_proposers import HASH_ORACLE_METHOD, register_hash_oracle
from kvflow.worker.states import RequestSlots

BLOCK_SIZE = 4


class FixedProposer(LookupProposer):
    """Drafts `[100, 101, ...]`, as many as asked (at most k), and records what it was asked."""

    def __init__(self, k: int, needs_kv_cache: bool = True) -> None:
        self.num_speculative_tokens = k
        self.needs_kv_cache = needs_kv_cache  # as a draft model: it is told what to catch up
        self.batches: list[DraftBatch] = []

    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        return list(range(100, 100 + min(self.num_speculative_tokens, max_drafts)))

    def propose_batch(self, batch: DraftBatch) -> dict[int, Proposal]:
        self.batches.append(batch)
        return super().propose_batch(batch)


def make_slots(*token_lists: list[int]) -> RequestSlots:
    slots = RequestSlots(4, 32, 8)
    for i, tokens in enumerate(token_lists):
        slots.add(
            f"r{i}", tokens, [2 * i, 2 * i + 1], len(tokens) - 1, SamplingParams(max_tokens=8)
        )
    return slots


def make_runner(slots: RequestSlots, proposer: Proposer, **options: int) -> SpecDecodeRunner:
    return SpecDecodeRunner(
        proposer, slots, block_size=BLOCK_SIZE, num_blocks=16, eos_token_id=None, **options
    )


def test_every_registered_proposer_is_a_proposer() -> None:
    register_hash_oracle()
    for method in ("ngram", "draft_model", HASH_ORACLE_METHOD):
        assert issubclass(SPEC_PROPOSERS.get(method), Proposer)
    with pytest.raises(TypeError):
        Proposer()  # type: ignore[abstract]


def test_a_lookup_proposer_costs_no_kv_and_drafts_per_slot() -> None:
    ngram = NgramProposer(SpeculativeConfig("ngram", 3))
    assert ngram.kv_cache_bytes_per_block(BLOCK_SIZE) == 0
    slots = make_slots([1, 2, 3, 1, 2], [7, 8, 9])
    proposals = ngram.propose_batch(DraftBatch(slots, {0: 2, 1: 5}, {}, None))
    assert proposals[0].token_ids == ngram.propose(np.array([1, 2, 3, 1, 2]), 2) == [3, 1]
    assert proposals[1].token_ids == [] and proposals[0].draft_probs is None


def test_write_pads_placeholders_and_plans_the_verification_rows() -> None:
    slots = make_slots([1, 2, 3], [4, 5, 6, 7], [8, 9])
    runner = make_runner(slots, FixedProposer(3))
    runner.slot_drafts[1] = [50]  # proposed while the step was in flight
    sampled_rows = np.array([0, 1, 2])
    logits_indices = np.array([2, 6, 8])
    scheduled = {"r0": [30, 31], "r1": [DRAFT_PLACEHOLDER, DRAFT_PLACEHOLDER]}
    step = runner.write(
        ["r0", "r1", "r2"], np.array([0, 1, 2]), scheduled, sampled_rows, logits_indices
    )
    assert step is not None
    assert step.drafts == {0: [30, 31], 1: [50, 0]}
    assert step.num_real_drafts == {1: 1} and step.draft_probs == {}
    assert step.sampled_rows.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert step.sample_offsets.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert step.logits_indices.tolist() == [0, 1, 2, 4, 5, 6, 8]
    assert step.real_draft_counts(3) == [2, 1, 0]
    # Uncommitted: written past num_tokens, which does not move.
    assert slots.token_ids[0, 3:5].tolist() == [30, 31] and slots.num_tokens[0] == 3
    assert slots.token_ids[1, 4:6].tolist() == [50, 0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.drafts = {}  # type: ignore[misc]
    assert (
        runner.write(["r0"], np.array([0]), {"r0": []}, sampled_rows[:1], logits_indices[:1])
        is None
    )
    assert runner.write(["r0"], np.array([0]), {}, sampled_rows[:1], logits_indices[:1]) is None


def test_accept_keeps_the_point_mass_prefix_and_commits_it() -> None:
    slots = make_slots([1, 2, 3])
    runner = make_runner(slots, FixedProposer(2))
    step = runner.write(["r0"], np.array([0]), {"r0": [30, 31]}, np.array([0]), np.array([2]))
    assert isinstance(step, SpecStep)
    slots.num_computed_tokens[0] += 3  # the runner counts every scheduled token first
    accepted = runner.accept(step, np.array([30, 44, 45]), {})
    assert accepted == [[30, 44]]
    assert slots.get_token_ids("r0") == [1, 2, 3, 30, 44]
    assert (
        slots.num_computed_tokens[0] == 2 + 3 - 1
    )  # the rejected draft's position is not computed


def test_propose_catches_up_all_but_failed_rows_and_obeys_disable_by_batch_size() -> None:
    slots = make_slots([1, 2, 3], [4, 5, 6])
    proposer = FixedProposer(2)
    runner = make_runner(slots, proposer, disable_by_batch_size=3)
    runner.slot_draft_probs[0] = torch.ones(1, 4)
    drafts = runner.propose(np.array([0, 1]), np.array([0, 1]), {1}, [[3], [6]])
    assert drafts == [[100, 101], [100, 101]]
    assert runner.slot_drafts[0] == [100, 101] and runner.slot_draft_probs[0] is None
    assert list(proposer.batches[-1].catch_up) == [0]  # a failed row is not caught up
    assert proposer.batches[-1].catch_up[0] == min(3, 2 * BLOCK_SIZE)
    lookup = FixedProposer(2, needs_kv_cache=False)
    make_runner(make_slots([1, 2, 3]), lookup).propose(np.array([0]), np.array([0]), set(), [[3]])
    assert lookup.batches[-1].catch_up == {}  # a proposer without a KV cache is spared building it
    slots3 = make_slots([1, 2, 3], [4, 5, 6], [7, 8, 9])
    runner3 = make_runner(slots3, FixedProposer(2), disable_by_batch_size=3)
    rows = np.array([0, 1, 2])
    assert runner3.propose(rows, rows, set(), [[3], [6], [9]]) == [[], [], []]
