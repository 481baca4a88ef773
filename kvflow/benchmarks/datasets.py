"""Benchmark prompts: the random dataset (vLLM's `--dataset random`), reproducible from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.tokenizer import Tokenizer

# Token ids drawn for token-id prompts when there is no tokenizer: low ids exist in every vocabulary.
TOKEN_ID_RANGE = (1, 1000)


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: a text or token-id prompt, its length in tokens, and the output length asked for."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    tokenizer: Tokenizer | None = None,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` requests whose input and output lengths are drawn uniformly from
    `[len * (1 - range_ratio), len * (1 + range_ratio)]` (at least 1), with random token ids. With `prefix_len`
    (vLLM's `--random-prefix-len`) every prompt starts with the same `prefix_len` random tokens, before its own.

    With a tokenizer the ids are decoded to text (and the prompt length is what the text encodes back to, which
    is what the server will see); without one the prompts are token-id lists. Same seed, same requests.
    """
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    rng = random.Random(seed)
    low, high = TOKEN_ID_RANGE if tokenizer is None else (0, tokenizer.vocab_size)
    prefix = [rng.randrange(low, high) for _ in range(prefix_len)]
    requests = []
    for _ in range(num_prompts):
        num_input = _draw_length(rng, input_len, range_ratio)
        num_output = _draw_length(rng, output_len, range_ratio)
        token_ids = prefix + [rng.randrange(low, high) for _ in range(num_input)]
        num_input += prefix_len
        if tokenizer is None:
            requests.append(SampleRequest(token_ids, num_input, num_output))
            continue
        text = tokenizer.decode(token_ids)
        requests.append(SampleRequest(text, len(tokenizer.encode(text)), num_output))
    return requests


def _draw_length(rng: random.Random, length: int, range_ratio: float) -> int:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.randint(low, high)
