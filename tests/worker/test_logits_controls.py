"""The sampler's logits controls on small vocabularies: `allowed_token_ids`, bad words (`bad_words_token_ids`) and
`logit_bias`; exactly which ids they ban or boost, where they sit among the other steps, and that rows without them
sample bit for bit as in a batch without the controlled rows."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvflow.sampling_params import SamplingParams
from kvflow.worker.sampler import Sampler, SamplingMetadata
from tests.worker.test_sampler import Row
from tests.worker.test_sampler import make_metadata as make_sampler_metadata

CPU = torch.device("cpu")
VOCAB = 10
EOS = 9
MAX_MODEL_LEN = 32
NEG_INF = float("-inf")


def make_metadata(rows: Sequence[Row], vocab_size: int = VOCAB) -> SamplingMetadata:
    """test_sampler's metadata (histories in scattered slots of a junk-filled token array), with this EOS."""
    return make_sampler_metadata(rows, vocab_size, eos_token_id=EOS)


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)  # type: ignore[arg-type]


def bad_words(*words: list[int], **kwargs: object) -> SamplingParams:
    """Greedy params carrying token-id bad words as the input processor would set them."""
    return greedy(bad_words=["x"], bad_words_token_ids=[list(word) for word in words], **kwargs)


def logits_for(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def processed_row(row: Row, logits: torch.Tensor | None = None) -> torch.Tensor:
    logits = logits_for(1) if logits is None else logits
    return Sampler.process_logits(logits.clone(), make_metadata([row]))[0]


def banned_ids(row_logits: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isneginf(row_logits)).flatten().tolist()


# ---------------------------------------------------------------------------------------------- allowed_token_ids
def test_allowed_token_ids_ban_every_other_id_and_keep_the_allowed_logits() -> None:
    logits = logits_for(1)
    processed = processed_row(Row(greedy(allowed_token_ids=[5, 2, 5])), logits)
    assert banned_ids(processed) == [0, 1, 3, 4, 6, 7, 8, 9]
    assert torch.equal(processed[[2, 5]], logits[0, [2, 5]])


def test_allowed_token_ids_outside_the_vocabulary_are_dropped() -> None:
    processed = processed_row(Row(greedy(allowed_token_ids=[4, VOCAB, VOCAB + 7])))
    assert banned_ids(processed) == [i for i in range(VOCAB) if i != 4]


def test_allowed_token_mask_covers_only_the_rows_that_set_it() -> None:
    rows = [
        Row(greedy()),
        Row(greedy(allowed_token_ids=[1])),
        Row(greedy(allowed_token_ids=[2, 3])),
    ]
    metadata = make_metadata(rows)
    assert metadata.allowed_token_mask is not None
    mask_rows, mask = metadata.allowed_token_mask
    assert mask_rows.tolist() == [1, 2] and mask.shape == (2, VOCAB)
    assert (~mask).nonzero().tolist() == [[0, 1], [1, 2], [1, 3]]
    assert metadata.bad_words_mask is None and metadata.logit_bias is None


def test_greedy_sampling_picks_the_best_allowed_token() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0, 0.5, 0, 0, 0, 0, 0]])
    metadata = make_metadata([Row(greedy(allowed_token_ids=[2, 3, 4]))])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [3]


def test_random_rows_sample_only_allowed_tokens() -> None:
    rows = [
        Row(SamplingParams(temperature=1.0, seed=i, allowed_token_ids=[0, 6])) for i in range(64)
    ]
    logits = torch.zeros(64, VOCAB)
    metadata = make_metadata(rows)
    assert set(Sampler()(logits, metadata).sampled_token_ids.tolist()) == {0, 6}


# ---------------------------------------------------------------------------------------------- bad words
def test_a_one_token_bad_word_is_banned_at_every_step() -> None:
    assert banned_ids(processed_row(Row(bad_words([4])))) == [4]
    assert banned_ids(processed_row(Row(bad_words([4]), outputs=[4, 4, 1]))) == [4]


def test_a_two_token_bad_word_bans_its_last_token_only_after_its_first() -> None:
    params = bad_words([5, 6])
    assert banned_ids(processed_row(Row(params))) == []
    assert banned_ids(processed_row(Row(params, outputs=[1, 5]))) == [6]
    assert banned_ids(processed_row(Row(params, outputs=[5, 1]))) == []
    # Only the outputs count (vLLM): a prompt ending with the prefix bans nothing yet.
    assert banned_ids(processed_row(Row(params, prompt=[1, 5]))) == []


def test_a_three_token_bad_word_needs_its_whole_prefix_in_the_outputs() -> None:
    params = bad_words([1, 2, 3])
    assert banned_ids(processed_row(Row(params, outputs=[7, 1, 2]))) == [3]
    assert banned_ids(processed_row(Row(params, outputs=[1, 2]))) == [3]
    assert banned_ids(processed_row(Row(params, outputs=[2, 2]))) == []
    assert banned_ids(processed_row(Row(params, outputs=[1, 2, 4]))) == []
    # The prefix straddles prompt and outputs: not a match.
    assert banned_ids(processed_row(Row(params, prompt=[4, 1], outputs=[2]))) == []


def test_several_bad_words_ban_each_completed_last_token_once() -> None:
    params = bad_words([8, 9], [5, 8, 9], [4], [7, 8, 3], [8, 2], [VOCAB + 1])
    metadata = make_metadata([Row(greedy()), Row(params, outputs=[5, 8])])
    assert metadata.bad_words_mask is not None
    rows, token_ids = metadata.bad_words_mask
    assert rows.tolist() == [1, 1, 1] and token_ids.tolist() == [2, 4, 9]


def test_a_bad_word_steers_greedy_sampling_to_the_next_best_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 0, 0, 0, 0, 0, 0]])
    free = make_metadata([Row(bad_words([6, 2]), outputs=[5])])
    assert free.bad_words_mask is None
    assert Sampler()(logits, free).sampled_token_ids.tolist() == [2]
    blocked = make_metadata([Row(bad_words([6, 2]), outputs=[6])])
    assert Sampler()(logits, blocked).sampled_token_ids.tolist() == [3]


# ---------------------------------------------------------------------------------------------- logit_bias
def test_logit_bias_adds_to_exactly_the_listed_ids() -> None:
    logits = logits_for(1)
    processed = processed_row(Row(greedy(logit_bias={1: 3.0, 4: -2.5, VOCAB: 100.0})), logits)
    expected = logits[0].clone()
    expected[1] += 3.0
    expected[4] -= 2.5
    assert torch.equal(processed, expected)


def test_logit_bias_of_100_forces_a_token_and_minus_100_removes_the_best() -> None:
    logits = torch.tensor([[0.0, 1.0, 6.0, 2.0, 0, 0, 0, 0, -3.0, 0]])
    down = make_metadata([Row(greedy(logit_bias={2: -100}))])
    assert Sampler()(logits, down).sampled_token_ids.tolist() == [3]
    up = make_metadata([Row(greedy(logit_bias={8: 100}))])
    assert Sampler()(logits, up).sampled_token_ids.tolist() == [8]


# ---------------------------------------------------------------------------------------------- order
def test_controls_apply_after_min_tokens_and_before_penalties() -> None:
    logits = torch.tensor([[1.0, 2.0, 0, 0, 0, 0, 0, 0, 0, 4.0]])
    params = greedy(
        logit_bias={0: 3.0, EOS: 1.0},
        repetition_penalty=2.0,
        min_tokens=2,
        allowed_token_ids=[0, 1, EOS],
    )
    processed = processed_row(Row(params, prompt=[0]), logits)
    # Token 0: (1 + 3) / 2 (bias, then the prompt's repetition penalty; penalty first would give 3.5).
    assert processed[0].item() == 2.0
    assert processed[1].item() == 2.0
    # EOS: min_tokens' -inf stays -inf whatever the bias; 2..8 are not allowed.
    assert banned_ids(processed) == [2, 3, 4, 5, 6, 7, 8, EOS]


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    logits = logits_for(1, seed=5)
    params = greedy(logprobs=2, allowed_token_ids=[3], logit_bias={3: 50.0})
    output = Sampler()(logits, make_metadata([Row(params)]))
    assert output.sampled_token_ids.tolist() == [3]
    assert output.logprobs is not None
    raw = logits[0].log_softmax(dim=-1)
    assert output.logprobs.logprob_token_ids[0][0] == 3
    assert output.logprobs.logprobs[0][0] == pytest.approx(raw[3].item(), abs=1e-6)
    assert output.logprobs.logprob_token_ids[0][1:] == raw.topk(2).indices.tolist()


# ---------------------------------------------------------------------------------------------- fast path, mixing
@pytest.mark.parametrize(
    ("params", "expected"),
    [(greedy(allowed_token_ids=[2]), 2), (greedy(logit_bias={2: 5.0}), 2), (bad_words([1]), 0)],
    ids=["allowed_token_ids", "logit_bias", "bad_words"],
)
def test_a_controlled_greedy_row_leaves_the_argmax_fast_path(
    params: SamplingParams, expected: int
) -> None:
    assert make_metadata([Row(greedy())]).is_plain_greedy
    metadata = make_metadata([Row(greedy()), Row(params)])
    assert not metadata.is_plain_greedy and metadata.has_logits_processing
    logits = torch.zeros(2, VOCAB)
    logits[:, 0], logits[:, 1] = 0.5, 1.0
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1, expected]


def test_a_bad_word_row_with_no_completed_prefix_keeps_the_fast_path() -> None:
    assert make_metadata([Row(bad_words([4, 5]), outputs=[1])]).is_plain_greedy


PLAIN_ROWS = [
    Row(greedy()),
    Row(SamplingParams(temperature=0.8, top_k=5, seed=11), outputs=[2, 4]),
    Row(greedy(logprobs=3), outputs=[6]),
    Row(SamplingParams(temperature=1.3, top_p=0.7, seed=-4, logprobs=1)),
    Row(greedy(repetition_penalty=1.5, presence_penalty=0.5), prompt=[1, 2, 3], outputs=[3]),
]
CONTROLLED_ROWS = [
    Row(greedy(allowed_token_ids=[0, 3])),
    Row(SamplingParams(temperature=0.9, seed=3, logit_bias={2: 20.0, 5: -5.0}, logprobs=2)),
    Row(bad_words([4], [1, 7]), outputs=[1]),
    Row(
        SamplingParams(
            temperature=0.7,
            seed=9,
            allowed_token_ids=[1, 2, 7],
            logit_bias={7: 2.0},
            bad_words=["x"],
            bad_words_token_ids=[[3, 2]],
        ),
        outputs=[3],
    ),
]


@pytest.mark.parametrize("step", range(4))
def test_rows_without_controls_sample_bit_for_bit_as_without_the_controlled_rows(step: int) -> None:
    torch.manual_seed(step)
    plain_logits = torch.randn(len(PLAIN_ROWS), VOCAB) * 2
    controlled_logits = torch.randn(len(CONTROLLED_ROWS), VOCAB) * 2
    alone = Sampler()(plain_logits, make_metadata(PLAIN_ROWS))
    # Interleave: controlled rows first, between and after the plain ones.
    order = ["c", "p", "p", "c", "p", "c", "p", "p", "c"]
    rows, logits, plain_at = [], [], []
    plain_iter, controlled_iter = iter(range(len(PLAIN_ROWS))), iter(range(len(CONTROLLED_ROWS)))
    for kind in order:
        if kind == "p":
            index = next(plain_iter)
            plain_at.append(len(rows))
            rows.append(PLAIN_ROWS[index])
            logits.append(plain_logits[index])
        else:
            index = next(controlled_iter)
            rows.append(CONTROLLED_ROWS[index])
            logits.append(controlled_logits[index])
    mixed = Sampler()(torch.stack(logits), make_metadata(rows))
    assert mixed.sampled_token_ids[plain_at].tolist() == alone.sampled_token_ids.tolist()
    assert alone.logprobs is not None and mixed.logprobs is not None
    for i, row in enumerate(plain_at):
        assert mixed.logprobs.logprob_token_ids[row] == alone.logprobs.logprob_token_ids[i]
        assert mixed.logprobs.logprobs[row] == alone.logprobs.logprobs[i]
        assert mixed.logprobs.sampled_token_ranks[row] == alone.logprobs.sampled_token_ranks[i]
    # And the controlled rows obeyed their controls.
    sampled = mixed.sampled_token_ids.tolist()
    assert sampled[0] in (0, 3)  # allowed_token_ids
    assert sampled[5] not in (4, 7)  # bad words [4] and [1, 7] after output 1
    assert sampled[8] in (1, 7)  # allowed 1, 2, 7, and 2 is banned after output 3
