"""Rejection sampling is lossless: whatever the drafts' distribution q, the emitted tokens are distributed as the
target's p, position by position (chi-square tests over seeded samples on a 6-token vocabulary).

Every chi-square statistic is compared with the critical value at p-value level 0.001 for its degrees of freedom
(no scipy in the environment); the seeds are fixed, so each test is deterministic, and a sampler that emits q, or
p renormalised the wrong way, fails them by far.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.spec_decode.rejection_sampler import accept_point_mass_drafts, rejection_sample

VOCAB = 6
K = 2
# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` over the support of `probs`, and its degrees of freedom;
    a count outside the support is an immediate failure."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts.tolist()}"
    total = counts.sum()
    expected = probs[support].double() * total
    statistic = ((counts[support].double() - expected) ** 2 / expected).sum()
    return float(statistic), int(support.sum()) - 1


def assert_distributed_as(tokens: list[int], probs: torch.Tensor) -> None:
    assert len(tokens) >= 1000, f"too few samples ({len(tokens)}) for a meaningful test"
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    statistic, dof = chi_square(counts, probs)
    if dof == 0:
        return  # a single token: the support check is the test
    assert statistic < CHI2_CRITICAL_0_001[dof], (statistic, dof, counts.tolist(), probs.tolist())


def random_probs(generator: torch.Generator, rows: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, VOCAB, generator=generator) * 1.5, dim=-1)


def run(
    target: torch.Tensor, draft: torch.Tensor, num_samples: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Draw each sample's drafts from `draft` (d_i ~ q_i, as a proposer would), verify them; (drafts, outputs)."""
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.stack(
        [
            torch.multinomial(row, num_samples, replacement=True, generator=generator)
            for row in draft
        ],
        dim=1,
    )
    outputs = [rejection_sample(target, draft, row, generator) for row in drafts]
    return drafts.tolist(), outputs


def check_lossless(target: torch.Tensor, outputs: list[list[int]]) -> None:
    """Position i's token, among the samples that reached position i, is distributed as p_i. (The synthetic p_i
    do not depend on the tokens before them, so "reached position i" is the only conditioning.)"""
    for position in range(K + 1):
        reached = [output[position] for output in outputs if len(output) > position]
        if position == 0 or len(reached) >= 1000:
            assert_distributed_as(reached, target[position])


def test_random_target_and_draft_distributions() -> None:
    generator = torch.Generator().manual_seed(1)
    target, draft = random_probs(generator, K + 1), random_probs(generator, K)
    drafts, outputs = run(target, draft, num_samples=20_000, seed=12)
    check_lossless(target, outputs)
    # The first draft is accepted with probability sum_x min(p_0(x), q_0(x)) (a binomial z-test, |z| < 3.3).
    accepted = sum(len(out) > 1 for out in outputs)
    rate = float(torch.minimum(target[0], draft[0]).sum())
    z = (accepted - rate * len(outputs)) / (rate * (1 - rate) * len(outputs)) ** 0.5
    assert abs(z) < 3.3, (accepted, rate)
    for drafted, output in zip(drafts, outputs, strict=True):
        assert 1 <= len(output) <= K + 1 and output[:-1] == drafted[: len(output) - 1]


def test_draft_equal_to_target_accepts_everything() -> None:
    generator = torch.Generator().manual_seed(3)
    target = random_probs(generator, K + 1)
    drafts, outputs = run(target, target[:K].clone(), num_samples=4000, seed=4)
    assert all(output[:K] == drafted for drafted, output in zip(drafts, outputs, strict=True))
    check_lossless(target, outputs)


def test_draft_disjoint_from_target_is_always_rejected() -> None:
    target = torch.zeros(K + 1, VOCAB)
    target[:, :3] = torch.tensor([0.5, 0.3, 0.2])
    draft = torch.zeros(K, VOCAB)
    draft[:, 3:] = torch.tensor([0.2, 0.3, 0.5])
    _, outputs = run(target, draft, num_samples=4000, seed=5)
    assert all(len(output) == 1 for output in outputs)
    check_lossless(target, outputs)  # the residual max(0, p - q) is p itself


def test_point_mass_draft() -> None:
    generator = torch.Generator().manual_seed(6)
    target = random_probs(generator, K + 1)
    draft = torch.zeros(K, VOCAB)
    draft[0, 2] = draft[1, 4] = 1.0  # the drafts are always 2, 4
    _, outputs = run(target, draft, num_samples=4000, seed=7)
    check_lossless(target, outputs)


def test_point_mass_acceptance_has_the_same_law() -> None:
    """accept_point_mass_drafts on rows sampled from p: token 0 ~ p_0, and after an accepted draft, p_1."""
    generator = torch.Generator().manual_seed(8)
    target = random_probs(generator, K + 1)
    drafts = [2, 4]
    rows = torch.stack(
        [torch.multinomial(row, 20_000, replacement=True, generator=generator) for row in target],
        dim=1,
    )
    outputs = [accept_point_mass_drafts(sampled, drafts) for sampled in rows.tolist()]
    check_lossless(target, outputs)
    accepted = sum(len(output) > 1 for output in outputs)
    rate = float(target[0, 2])
    z = (accepted - rate * len(outputs)) / (rate * (1 - rate) * len(outputs)) ** 0.5
    assert abs(z) < 3.3


def test_one_hot_target_is_deterministic() -> None:
    """Greedy: p one-hot on the argmax. Drafts are kept while they equal the argmax; the next token is the argmax,
    whatever q and the random draws."""
    argmax = [3, 1, 5]
    target = torch.nn.functional.one_hot(torch.tensor(argmax), VOCAB).float()
    generator = torch.Generator().manual_seed(9)
    draft = random_probs(generator, K)
    cases = {(3, 1): [3, 1, 5], (3, 0): [3, 1], (0, 1): [3], (2, 2): [3]}
    for drafted, expected in cases.items():
        for seed in range(20):
            generator.manual_seed(seed)
            assert rejection_sample(target, draft, torch.tensor(drafted), generator) == expected
            assert accept_point_mass_drafts(argmax, list(drafted)) == expected


def test_seeded_generators_reproduce_the_output() -> None:
    generator = torch.Generator().manual_seed(10)
    target, draft = random_probs(generator, K + 1), random_probs(generator, K)
    drafted = torch.tensor([1, 2])
    first = [
        rejection_sample(target, draft, drafted, torch.Generator().manual_seed(s))
        for s in range(50)
    ]
    again = [
        rejection_sample(target, draft, drafted, torch.Generator().manual_seed(s))
        for s in range(50)
    ]
    assert first == again


def test_no_drafts_samples_the_bonus_only() -> None:
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    assert rejection_sample(
        target, torch.zeros(0, VOCAB), torch.zeros(0, dtype=torch.long), None
    ) == [2]
    assert accept_point_mass_drafts([4], []) == [4]


def test_zero_draft_probability_and_zero_target_probability() -> None:
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    draft = torch.zeros(1, VOCAB)  # q(d) = 0: p(d) > 0 accepts, p(d) = 0 rejects
    assert rejection_sample(target, draft, torch.tensor([1]), None) == [1, 2]
    assert rejection_sample(target, draft, torch.tensor([3]), None) == [1]


def test_shape_mismatches_are_errors() -> None:
    with pytest.raises(
        ValueError, match=r"target_probs \[k\+1, V\] and draft_probs \[k, V\] for k=2"
    ):
        rejection_sample(torch.ones(2, VOCAB), torch.ones(2, VOCAB), torch.tensor([0, 1]), None)
    with pytest.raises(ValueError, match="one sampled token per draft plus the bonus"):
        accept_point_mass_drafts([1, 2], [1, 2])


def test_point_mass_examples() -> None:
    assert accept_point_mass_drafts([7, 8, 9], [7, 8]) == [7, 8, 9]  # all accepted + bonus
    assert accept_point_mass_drafts([7, 5, 9], [7, 8]) == [7, 5]  # correction at the first mismatch
    assert accept_point_mass_drafts([6, 8, 9], [7, 8]) == [6]  # a later agreement does not count
