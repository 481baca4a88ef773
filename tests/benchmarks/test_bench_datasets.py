"""Benchmark prompts with a real tokenizer: random text prompts of exactly the asked length, ShareGPT files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvflow.benchmarks.datasets import random_requests, sharegpt_requests
from kvflow.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE (1,024 tokens, BOS added) trained on the spot, as the default model's is."""
    from kvflow.default_model.random_weights import build_tokenizer
    from kvflow.default_model.tokenizer import BOS_TOKEN

    return Tokenizer(build_tokenizer(), special_tokens={"bos_token": BOS_TOKEN})


def test_random_text_prompts_encode_to_exactly_the_input_length(tokenizer: Tokenizer) -> None:
    # `kvflow bench serve --random-input-len 64 --num-prompts 20`: random ids decoded to text encode back to more
    # tokens (1,666 here before the fix), so the text is trimmed / extended until it is 64 tokens, BOS included.
    samples = random_requests(20, 64, 8, 0.0, seed=0, tokenizer=tokenizer)
    assert sum(sample.prompt_len for sample in samples) == 20 * 64
    for sample in samples:
        assert isinstance(sample.prompt, str)
        assert len(tokenizer.encode(sample.prompt)) == 64
    assert samples == random_requests(20, 64, 8, 0.0, seed=0, tokenizer=tokenizer)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_exact_lengths_hold_for_short_prompts_ranges_and_shared_prefixes(
    tokenizer: Tokenizer, add_special_tokens: bool
) -> None:
    for seed in range(12):
        samples = random_requests(
            4,
            input_len=20,
            output_len=4,
            range_ratio=0.5,
            seed=seed,
            tokenizer=tokenizer,
            prefix_len=6,
            add_special_tokens=add_special_tokens,
        )
        texts = [sample.prompt for sample in samples]
        for sample in samples:
            assert isinstance(sample.prompt, str)
            encoded = tokenizer.encode(sample.prompt, add_special_tokens=add_special_tokens)
            assert len(encoded) == sample.prompt_len and 6 + 10 <= sample.prompt_len <= 6 + 30
        # Every prompt starts with the same text of (at least) the prefix's 6 tokens.
        shared = os.path.commonprefix(texts)  # noqa: RUF071 (texts, not paths)
        assert len(tokenizer.encode(shared, add_special_tokens=False)) >= 6


def write_sharegpt(path: Path, conversations: list[list[str]]) -> Path:
    entries = [
        {"id": str(index), "conversations": [{"from": "x", "value": turn} for turn in turns]}
        for index, turns in enumerate(conversations)
    ]
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_prompts_are_first_turns_with_their_reply_lengths(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    long_question = "tell me about the weather in the mountains today and tomorrow please"
    path = write_sharegpt(
        tmp_path / "sharegpt.json",
        [
            [long_question, "it will be sunny with some clouds in the afternoon"],
            ["hi", "hello there, how are you doing today my friend"],  # a prompt under 4 tokens
            ["only one turn, no reply to measure"],
            [long_question + " again", "rain"],  # a reply under 4 tokens
        ],
    )
    [sample] = sharegpt_requests(path, 1, tokenizer, seed=0)
    assert sample.prompt == long_question
    assert sample.prompt_len == len(tokenizer.encode(long_question))
    assert sample.expected_output_len == len(
        tokenizer.encode("it will be sunny with some clouds in the afternoon", False)
    )
    # --output-len replaces the replies' lengths (the short reply is kept then), and the kept conversations are
    # drawn again to make up --num-prompts.
    samples = sharegpt_requests(path, 5, tokenizer, seed=0, output_len=7)
    assert len(samples) == 5 and {sample.expected_output_len for sample in samples} == {7}
    assert {sample.prompt for sample in samples} == {long_question, long_question + " again"}
    with pytest.raises(ValueError, match="no conversation"):
        sharegpt_requests(
            write_sharegpt(tmp_path / "short.json", [["hi", "hello"]]), 1, tokenizer, 0
        )
    (tmp_path / "bad.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match=r"bad\.json: expected a JSON list"):
        sharegpt_requests(tmp_path / "bad.json", 1, tokenizer, 0)
