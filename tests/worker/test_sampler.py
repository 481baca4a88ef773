"""The batched sampler: greedy, penalties, min_tokens, temperature / min-p / top-k / top-p distributions, per-request
seeds, logprobs and row isolation, all on real tensors against straightforward reference computations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvflow.sampling_params import SamplingParams
from kvflow.worker.sampler import (
    Sampler,
    SamplingMetadata,
    argmax_rows,
    build_sampling_metadata,
    mix_seed,
    samples_argmax_only,
)

CPU = torch.device("cpu")
EOS = 2
MAX_MODEL_LEN = 48


@dataclass
class Row:
    """One sampled row: its request's settings, prompt and outputs so far."""

    params: SamplingParams
    prompt: list[int] = field(default_factory=lambda: [1, 3])
    outputs: list[int] = field(default_factory=list)


def make_metadata(
    rows: Sequence[Row],
    vocab_size: int,
    *,
    eos_token_id: int | None = EOS,
    slot_indices: Sequence[int] | None = None,
    layout_seed: int = 0,
) -> SamplingMetadata:
    """Metadata for `rows` read from a runner-like token array whose unused entries hold random junk tokens."""
    rng = np.random.default_rng(layout_seed)
    num_slots = len(rows) + 3
    token_ids = rng.integers(0, vocab_size, (num_slots, MAX_MODEL_LEN), dtype=np.int64)
    slots = np.array(
        slot_indices if slot_indices is not None else rng.permutation(num_slots)[: len(rows)],
        dtype=np.int64,
    )
    for row, slot in zip(rows, slots.tolist(), strict=True):
        history = row.prompt + row.outputs
        token_ids[slot, : len(history)] = history
    return build_sampling_metadata(
        [row.params for row in rows],
        token_ids=token_ids,
        slot_indices=slots,
        num_prompt_tokens=np.array([len(row.prompt) for row in rows], dtype=np.int64),
        num_tokens=np.array([len(row.prompt) + len(row.outputs) for row in rows], dtype=np.int64),
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        device=CPU,
    )


def sample(
    rows: Sequence[Row],
    logits: torch.Tensor,
    *,
    sampler: Sampler | None = None,
    eos_token_id: int | None = EOS,
    layout_seed: int = 0,
) -> list[int]:
    metadata = make_metadata(
        rows, logits.shape[1], eos_token_id=eos_token_id, layout_seed=layout_seed
    )
    return (sampler or Sampler())(logits, metadata).sampled_token_ids.tolist()


def random_logits(num_rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("temperature", [0.0, 1e-7])
def test_greedy_rows_take_the_argmax(temperature: float) -> None:
    logits = random_logits(16, 100, seed=1)
    rows = [Row(SamplingParams(temperature=temperature)) for _ in range(16)]
    metadata = make_metadata(rows, 100)
    assert metadata.all_greedy and metadata.is_plain_greedy
    output = Sampler()(logits, metadata)
    assert output.sampled_token_ids.dtype == torch.int64
    assert output.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert output.logprobs is None


def test_empty_batch_samples_nothing() -> None:
    metadata = make_metadata([], 10)
    output = Sampler()(torch.empty(0, 10), metadata)
    assert output.sampled_token_ids.shape == (0,) and output.sampled_token_ids.dtype == torch.int64
    assert output.logprobs is None


def test_caller_logits_are_not_modified() -> None:
    logits = random_logits(3, 40, seed=2)
    before = logits.clone()
    rows = [
        Row(SamplingParams(temperature=0, repetition_penalty=2.0, min_tokens=2), outputs=[5]),
        Row(SamplingParams(top_k=3, top_p=0.5, min_p=0.1, temperature=0.7, presence_penalty=1.0)),
        Row(SamplingParams(seed=4, logprobs=2)),
    ]
    Sampler()(logits, make_metadata(rows, 40))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------- penalties
def reference_penalised(
    logits: list[float], prompt: list[int], outputs: list[int], params: SamplingParams
) -> list[float]:
    """vLLM / HF penalties written out one token at a time."""
    counts = Counter(outputs)
    result = []
    for token_id, logit in enumerate(logits):
        value = logit
        if token_id in prompt or counts[token_id] > 0:
            value = (
                value / params.repetition_penalty
                if value > 0
                else value * params.repetition_penalty
            )
        value -= params.frequency_penalty * counts[token_id]
        value -= params.presence_penalty * (counts[token_id] > 0)
        result.append(value)
    return result


PENALTY_CASES = {
    "repetition": {"repetition_penalty": 1.8},
    "repetition_below_one": {"repetition_penalty": 0.6},
    "frequency": {"frequency_penalty": 0.9},
    "negative_frequency": {"frequency_penalty": -0.7},
    "presence": {"presence_penalty": 1.3},
    "all": {"repetition_penalty": 1.4, "frequency_penalty": 0.5, "presence_penalty": -0.8},
}


@pytest.mark.parametrize("case", sorted(PENALTY_CASES))
def test_penalties_match_reference(case: str) -> None:
    vocab_size, num_rows = 30, 12
    rng = np.random.default_rng(7)
    rows = []
    for i in range(num_rows):
        prompt = rng.integers(0, vocab_size, rng.integers(1, 10)).tolist()
        outputs = rng.integers(0, 12, rng.integers(0, 15)).tolist()  # small ids: repeated outputs
        params = (
            SamplingParams(temperature=0, **PENALTY_CASES[case])
            if i % 4
            else SamplingParams(temperature=0)
        )
        rows.append(Row(params, prompt, outputs))
    logits = random_logits(num_rows, vocab_size, seed=3)
    metadata = make_metadata(rows, vocab_size)
    assert metadata.penalties is not None and metadata.penalties.prompt_mask.shape == (
        9,
        vocab_size,
    )

    penalty_rows = metadata.penalties.rows.tolist()
    assert penalty_rows == [i for i in range(num_rows) if i % 4]
    for i, row in enumerate(penalty_rows):
        assert set(metadata.penalties.prompt_mask[i].nonzero().flatten().tolist()) == set(
            rows[row].prompt
        )
        counts = Counter(rows[row].outputs)
        assert metadata.penalties.output_counts[i].tolist() == [
            counts[t] for t in range(vocab_size)
        ]

    processed = Sampler.process_logits(logits, metadata)
    expected = torch.tensor(
        [
            reference_penalised(logits[i].tolist(), row.prompt, row.outputs, row.params)
            for i, row in enumerate(rows)
        ]
    )
    torch.testing.assert_close(processed, expected)
    assert not torch.allclose(expected, logits)  # the penalty changed something
    assert torch.equal(processed[::4], logits[::4])  # rows without penalties are untouched
    assert sample(rows, logits) == expected.argmax(dim=-1).tolist()


def test_penalties_flip_the_greedy_choice_away_from_seen_tokens() -> None:
    vocab_size = 20
    logits = torch.zeros(4, vocab_size)
    logits[:, 5] = 2.0  # seen token, best raw logit
    logits[:, 9] = 1.5  # unseen runner-up
    rows = [
        Row(
            SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[5, 1]
        ),  # seen in the prompt
        Row(SamplingParams(temperature=0, frequency_penalty=0.3), prompt=[1], outputs=[5, 5]),
        Row(SamplingParams(temperature=0, presence_penalty=0.6), prompt=[1], outputs=[5]),
        Row(SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0), prompt=[5]),
    ]
    # Frequency / presence count outputs only: the last row's 5 is only in its prompt, so it keeps 5.
    assert sample(rows, logits) == [9, 9, 9, 5]


# ---------------------------------------------------------------------------------------------- min_tokens
def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab_size = 16
    logits = torch.zeros(8, vocab_size)
    logits[:, EOS] = 5.0
    logits[:, 7] = 4.0
    logits[:, 11] = 3.0
    logits[:, 4] = 2.0
    rows = [
        Row(
            SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7, 11]),
            outputs=[9] * position,
        )
        for position in range(5)
    ]
    rows.append(Row(SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), outputs=[9]))
    rows.append(
        Row(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7, 99]), outputs=[9])
    )
    rows.append(Row(SamplingParams(temperature=0, min_tokens=0, stop_token_ids=[7])))
    assert sample(rows, logits) == [4, 4, 4, EOS, EOS, 7, 11, EOS]
    # Without a model EOS only the stop ids are masked.
    assert sample(rows[:1], logits[:1], eos_token_id=None) == [EOS]


def test_min_tokens_random_rows_never_draw_masked_tokens() -> None:
    vocab_size, num_rows = 8, 4000
    logits = torch.zeros(num_rows, vocab_size)
    logits[:, [EOS, 5]] = 3.0  # most of the mass
    rows = [
        Row(SamplingParams(min_tokens=2, stop_token_ids=[5]), outputs=[1]) for _ in range(num_rows)
    ]
    counts = np.bincount(sample(rows, logits), minlength=vocab_size)
    assert counts[EOS] == 0 and counts[5] == 0
    assert (np.delete(counts, [EOS, 5]) > 0).all()
    released = [
        Row(SamplingParams(min_tokens=2, stop_token_ids=[5]), outputs=[1, 1])
        for _ in range(num_rows)
    ]
    assert np.bincount(sample(released, logits), minlength=vocab_size)[[EOS, 5]].min() > 0


# ---------------------------------------------------------------------------------------------- distributions
DIST_VOCAB = 32
DIST_LOGITS = torch.linspace(2.5, -2.5, DIST_VOCAB)[
    torch.randperm(DIST_VOCAB, generator=torch.Generator().manual_seed(5))
]


def reference_distribution(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """float64 reference: temperature, min-p, top-k (renormalised), top-p (smallest prefix with mass >= top_p)."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1).numpy()
    probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(probs.size, dtype=bool)
    top_k = params.top_k if params.top_k > 0 else probs.size
    kept_mass, total = 0.0, probs[order[:top_k]].sum()
    for token_id in order[:top_k]:
        if probs[token_id] == 0 or kept_mass >= params.top_p * total:
            break
        keep[token_id] = True
        kept_mass += probs[token_id]
    truncated = np.where(keep, probs, 0.0)
    return truncated / truncated.sum()


def assert_matches_distribution(token_ids: list[int], expected: np.ndarray) -> None:
    num_samples = len(token_ids)
    frequencies = np.bincount(token_ids, minlength=expected.size) / num_samples
    assert (frequencies[expected == 0] == 0).all(), "sampled a token outside the allowed set"
    tolerance = 5 * np.sqrt(expected * (1 - expected) / num_samples) + 1e-3
    assert (np.abs(frequencies - expected) <= tolerance).all(), np.abs(frequencies - expected).max()


DISTRIBUTION_CASES = {
    "plain": SamplingParams(),
    "temperature_0.5": SamplingParams(temperature=0.5),
    "temperature_2": SamplingParams(temperature=2.0),
    "top_k": SamplingParams(top_k=5),
    "top_p": SamplingParams(top_p=0.6),
    "min_p": SamplingParams(min_p=0.2),
    "min_p_after_temperature": SamplingParams(temperature=0.5, min_p=0.1),
    "top_k_top_p": SamplingParams(top_k=8, top_p=0.7),
    "everything": SamplingParams(temperature=0.8, min_p=0.05, top_k=10, top_p=0.8),
}


@pytest.mark.parametrize("case", sorted(DISTRIBUTION_CASES))
def test_truncated_sampling_matches_the_renormalised_distribution(case: str) -> None:
    params = DISTRIBUTION_CASES[case]
    num_samples = 20_000
    expected = reference_distribution(DIST_LOGITS, params)
    if params.top_k > 0 or params.top_p < 1 or params.min_p > 0:
        assert 1 < np.count_nonzero(expected) < DIST_VOCAB  # the case really truncates
    rows = [Row(params)] * num_samples
    token_ids = sample(
        rows, DIST_LOGITS.expand(num_samples, -1).contiguous(), sampler=Sampler(seed=11)
    )
    assert_matches_distribution(token_ids, expected)


def test_temperature_sharpens_and_flattens() -> None:
    num_samples = 10_000
    logits = DIST_LOGITS.expand(num_samples, -1).contiguous()
    best = int(DIST_LOGITS.argmax())
    share = {}
    for temperature in (0.3, 1.0, 3.0):
        token_ids = sample(
            [Row(SamplingParams(temperature=temperature))] * num_samples, logits, sampler=Sampler(1)
        )
        share[temperature] = token_ids.count(best) / num_samples
    assert share[0.3] > share[1.0] + 0.1 and share[1.0] > share[3.0] + 0.05


def test_truncation_metadata_only_when_a_random_row_uses_it() -> None:
    vocab_size = 10
    unused = [
        Row(SamplingParams(top_k=0)),
        Row(SamplingParams(top_k=-1)),
        Row(SamplingParams(top_k=10)),
        Row(SamplingParams(temperature=0, top_k=2, top_p=0.5, min_p=0.5)),
    ]
    metadata = make_metadata(unused, vocab_size)
    assert (
        metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    )  # no sort at all
    assert not metadata.all_greedy and not metadata.all_random
    used = make_metadata([*unused, Row(SamplingParams(top_k=3, top_p=0.9, min_p=0.1))], vocab_size)
    assert used.top_k is not None and used.top_p is not None and used.min_p is not None
    assert used.top_k.tolist() == [10, 10, 10, 10, 3]
    assert used.top_p.tolist() == pytest.approx([1, 1, 1, 1, 0.9])
    assert used.min_p.tolist() == pytest.approx([0, 0, 0, 0, 0.1])


def test_top_k_larger_than_vocab_is_off() -> None:
    num_samples = 5000
    token_ids = sample(
        [Row(SamplingParams(top_k=1000))] * num_samples,
        DIST_LOGITS.expand(num_samples, -1).contiguous(),
        sampler=Sampler(3),
    )
    assert_matches_distribution(token_ids, reference_distribution(DIST_LOGITS, SamplingParams()))


# ---------------------------------------------------------------------------------------------- seeds
FLAT_VOCAB = 1000


def flat_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    """Near-uniform rows over a large vocabulary: two different draws almost never agree."""
    return random_logits(1, FLAT_VOCAB, seed, scale=0.3).expand(num_rows, -1).contiguous()


def seeded_row(seed: int, position: int, **kwargs: object) -> Row:
    return Row(SamplingParams(seed=seed, **kwargs), outputs=[4] * position)  # type: ignore[arg-type]


@pytest.mark.parametrize(("seed", "position"), [(0, 0), (1234, 3), (-5, 17), (-(2**63) + 1, 9)])
def test_seeded_row_is_independent_of_the_batch(seed: int, position: int) -> None:
    target = seeded_row(seed, position)
    alone = sample([target], flat_logits(1))
    neighbours = [
        Row(SamplingParams()),
        Row(SamplingParams(temperature=0)),
        seeded_row(seed + 1, position),
        seeded_row(seed, position + 1),
        Row(SamplingParams(top_k=3, top_p=0.5)),
    ]
    batches = [
        [*neighbours[:2], target, *neighbours[2:]],
        [*neighbours, target],
        [target, *neighbours[::-1]],
    ]
    for i, batch in enumerate(batches):
        tokens = sample(batch, flat_logits(len(batch)), sampler=Sampler(seed=i), layout_seed=i)
        assert tokens[batch.index(target)] == alone[0]
    # A preempted request recomputes: fresh metadata, another slot, another sampler; the same draw.
    assert sample([target], flat_logits(1), sampler=Sampler(seed=99), layout_seed=5) == alone


def test_seeded_draws_change_with_position_and_seed() -> None:
    by_position = sample([seeded_row(42, position) for position in range(20)], flat_logits(20))
    by_seed = sample([seeded_row(seed, 5) for seed in range(20)], flat_logits(20))
    assert len(set(by_position)) >= 15 and len(set(by_seed)) >= 15
    assert mix_seed(42, 0) != mix_seed(42, 1) and mix_seed(42, 0) != mix_seed(43, 0)


def test_seeded_draws_follow_the_distribution() -> None:
    num_samples = 8000
    params = {"top_k": 12, "temperature": 0.9}
    expected = reference_distribution(DIST_LOGITS, SamplingParams(**params))  # type: ignore[arg-type]
    logits = DIST_LOGITS.expand(num_samples, -1).contiguous()
    across_seeds = sample([seeded_row(seed, 3, **params) for seed in range(num_samples)], logits)
    assert_matches_distribution(across_seeds, expected)
    # One request's successive outputs: positions 0 .. num_samples - 1 of seed 77 (no penalties: no history read).
    metadata = build_sampling_metadata(
        [SamplingParams(seed=77, **params)] * num_samples,  # type: ignore[arg-type]
        token_ids=np.zeros((1, num_samples), dtype=np.int64),
        slot_indices=np.zeros(num_samples, dtype=np.int64),
        num_prompt_tokens=np.zeros(num_samples, dtype=np.int64),
        num_tokens=np.arange(num_samples, dtype=np.int64),
        vocab_size=DIST_VOCAB,
        eos_token_id=None,
        device=CPU,
    )
    across_positions = Sampler()(logits, metadata).sampled_token_ids.tolist()
    assert_matches_distribution(across_positions, expected)


def test_unseeded_rows_are_reproducible_for_a_sampler_seed() -> None:
    rows = [Row(SamplingParams()) for _ in range(16)]

    def run(sampler_seed: int) -> list[list[int]]:
        sampler = Sampler(seed=sampler_seed)
        return [sample(rows, flat_logits(16, seed=step), sampler=sampler) for step in range(3)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first
    assert first[0] != first[1]  # the generator advances between steps


# ---------------------------------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_sampled_first_then_top_k() -> None:
    vocab_size = 50
    rows = [
        Row(SamplingParams(temperature=1.5, logprobs=3, repetition_penalty=1.5), outputs=[1, 2]),
        Row(SamplingParams(temperature=0, logprobs=0, presence_penalty=1.0), outputs=[7]),
        Row(SamplingParams(temperature=2.0)),
        Row(SamplingParams(temperature=3.0, top_k=20, logprobs=5, seed=3)),
        Row(SamplingParams(temperature=3.0, logprobs=2, seed=8)),
    ]
    logits = random_logits(len(rows), vocab_size, seed=9)
    metadata = make_metadata(rows, vocab_size)
    assert metadata.logprob_rows == [0, 1, 3, 4] and metadata.max_num_logprobs == 5
    output = Sampler()(logits, metadata)
    assert output.logprobs is not None
    sampled = output.sampled_token_ids.tolist()
    raw = torch.log_softmax(logits, dim=-1)
    for row, k in zip((0, 1, 3, 4), (3, 0, 5, 2), strict=True):
        ids, values = output.logprobs.logprob_token_ids[row], output.logprobs.logprobs[row]
        top_values, top_ids = raw[row].topk(k)
        assert ids == [sampled[row], *top_ids.tolist()]
        assert values == pytest.approx(
            [raw[row, sampled[row]].item(), *top_values.tolist()], abs=1e-6
        )
        assert values[1:] == sorted(values[1:], reverse=True)
        assert output.logprobs.sampled_token_ranks[row] == 1 + int(
            (raw[row] > raw[row, sampled[row]]).sum()
        )
    assert output.logprobs.logprob_token_ids[2] == [] and output.logprobs.logprobs[2] == []
    assert output.logprobs.sampled_token_ranks[2] == -1


def test_logprob_ranks_over_many_draws() -> None:
    num_samples = 500
    logits = DIST_LOGITS.expand(num_samples, -1).contiguous()
    rows = [Row(SamplingParams(temperature=2.0, logprobs=1))] * num_samples
    output = Sampler(5)(logits, make_metadata(rows, DIST_VOCAB))
    assert output.logprobs is not None
    order = DIST_LOGITS.argsort(descending=True).tolist()
    expected_ranks = [order.index(token_id) + 1 for token_id in output.sampled_token_ids.tolist()]
    assert output.logprobs.sampled_token_ranks == expected_ranks
    assert max(expected_ranks) > 3  # ranks other than 1 were exercised
    assert all(ids[1] == order[0] for ids in output.logprobs.logprob_token_ids)


def test_greedy_logprobs_rank_one_and_no_logprobs_when_nobody_asks() -> None:
    logits = random_logits(3, 20, seed=4)
    output = Sampler()(
        logits, make_metadata([Row(SamplingParams(temperature=0, logprobs=2))] * 3, 20)
    )
    assert output.logprobs is not None and output.logprobs.sampled_token_ranks == [1, 1, 1]
    assert all(ids[0] == ids[1] for ids in output.logprobs.logprob_token_ids)
    assert Sampler()(logits, make_metadata([Row(SamplingParams(seed=1))] * 3, 20)).logprobs is None


# ---------------------------------------------------------------------------------------------- isolation
def test_mixed_batch_rows_match_their_solo_results() -> None:
    rows = [
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(temperature=0, frequency_penalty=2.0), outputs=[3, 3]),
        seeded_row(1, 0),
        seeded_row(2, 1, top_k=3),
        seeded_row(3, 2, top_p=0.05),
        seeded_row(4, 0, min_p=0.9),
        seeded_row(5, 3, temperature=0.2),
        seeded_row(6, 0, min_tokens=4, stop_token_ids=[8]),
        seeded_row(7, 2, repetition_penalty=3.0, logprobs=2),
        Row(SamplingParams(top_k=2)),
    ]
    logits = random_logits(len(rows), 60, seed=13)
    batch_tokens = sample(rows, logits, sampler=Sampler(21))
    solo_tokens = [sample([row], logits[i : i + 1], layout_seed=i)[0] for i, row in enumerate(rows)]
    assert batch_tokens[:-1] == solo_tokens[:-1]
    assert batch_tokens[-1] in logits[-1].topk(2).indices.tolist()
    reversed_tokens = sample(rows[::-1], logits.flip(0), sampler=Sampler(22))
    assert reversed_tokens[::-1][:-1] == solo_tokens[:-1]
    # The truncating rows really truncated and the plain seeded row did not inherit their settings.
    assert batch_tokens[3] in logits[3].topk(3).indices.tolist()
    assert batch_tokens[4] == int(logits[4].argmax()) and batch_tokens[5] == int(logits[5].argmax())
    assert batch_tokens[7] not in (EOS, 8)


def test_fast_path_only_for_plain_greedy_batches() -> None:
    plain = make_metadata([Row(SamplingParams(temperature=0))] * 2, 10)
    assert plain.is_plain_greedy and plain.penalties is None and plain.min_tokens_mask is None
    for params in (
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0, presence_penalty=1.0),
        SamplingParams(temperature=0, min_tokens=1),
        SamplingParams(),
    ):
        assert not make_metadata(
            [Row(SamplingParams(temperature=0)), Row(params)], 10
        ).is_plain_greedy


ARGMAX_ONLY_CASES = [
    (SamplingParams(temperature=0), 0),
    (SamplingParams(temperature=1e-7, max_tokens=8, ignore_eos=True), 0),
    (SamplingParams(temperature=0, min_tokens=2), 2),  # min_tokens reached: nothing left to ban
    (SamplingParams(temperature=0, min_tokens=2), 1),
    (SamplingParams(temperature=0, logprobs=0), 0),
    (SamplingParams(temperature=0, repetition_penalty=1.5), 0),
    (SamplingParams(temperature=0, frequency_penalty=0.5), 0),
    (SamplingParams(temperature=0, presence_penalty=-0.5), 0),
    (SamplingParams(temperature=0, allowed_token_ids=[1, 4]), 0),
    (SamplingParams(temperature=0, logit_bias={3: 2.0}), 0),
    (SamplingParams(temperature=0.5), 0),
    (SamplingParams(), 0),
]


@pytest.mark.parametrize(("params", "num_outputs"), ARGMAX_ONLY_CASES)
def test_argmax_only_rows_are_plain_greedy_rows(params: SamplingParams, num_outputs: int) -> None:
    """The runner skips the metadata for rows `samples_argmax_only` accepts: it must never accept one whose
    metadata would process its logits (a bad word and the float32 temperature rule included)."""
    row = Row(params, outputs=[5] * num_outputs)
    expected = make_metadata([row], 10).is_plain_greedy
    assert samples_argmax_only(params, num_outputs) == expected
    bad_words = SamplingParams(temperature=0)
    bad_words.bad_words_token_ids = [[7]]
    assert not samples_argmax_only(bad_words, 0)
    assert not make_metadata([Row(bad_words)], 10).is_plain_greedy
    # Just above the greedy bound in float64 but equal to it in float32: both call it random.
    at_bound = SamplingParams(temperature=float(np.float32(1e-5)))
    assert samples_argmax_only(at_bound, 0) == make_metadata([Row(at_bound)], 10).is_plain_greedy


def test_argmax_only_matches_the_sampler_on_the_same_rows() -> None:
    logits = random_logits(5, 300, seed=7)
    rows = [Row(SamplingParams(temperature=0)) for _ in range(5)]
    output = Sampler.argmax_only(logits)
    assert output.logprobs is None and output.sampled_token_ids.dtype == torch.int64
    assert output.sampled_token_ids.tolist() == sample(rows, logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_agrees_with_torch_on_ties_infinities_and_nan(dtype: torch.dtype) -> None:
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # a tie: the first maximum
            [-inf, -inf, -inf, -inf],  # every token banned
            [1.0, nan, 5.0, nan],  # NaN counts as the maximum, the first one wins
            [inf, 1.0, inf, 0.0],
            [-0.0, 0.0, -1.0, -2.0],
        ],
        dtype=dtype,
    )
    big = random_logits(3, 4096, seed=3).to(dtype)
    for case in (logits, big, big[:, ::2], big[1:]):  # strided and offset views too
        result = argmax_rows(case)
        assert result.dtype == torch.int64
        assert result.tolist() == case.argmax(dim=-1).tolist()
