"""Benchmark prompts: the random dataset (vLLM's `--dataset-name random`), reproducible from a seed, and
ShareGPT-style JSON conversations (`--dataset-name sharegpt`)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.tokenizer import Tokenizer

# Token ids drawn for token-id prompts when there is no tokenizer: low ids exist in every vocabulary.
TOKEN_ID_RANGE = (1, 1000)
# Rounds of decode / re-encode / trim-or-extend before a text prompt keeps the length it has (reported as it is).
MAX_FIT_ROUNDS = 32
# ShareGPT conversations vLLM keeps: prompt and output of at least 4 tokens, a prompt of at most 1024, both of at
# most 2048 together (an --output-len given on the command line replaces the conversation's own output length).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

DrawTokens = Callable[[int], list[int]]


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: a text or token-id prompt, its length in tokens, and the output length asked for.

    For a text prompt `prompt_len` is what the tokenizer that made it encodes it to (with the special tokens the
    request's endpoint adds), so it is the number of tokens the server is sent."""

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
    *,
    add_special_tokens: bool = True,
    token_id_range: tuple[int, int] = TOKEN_ID_RANGE,
) -> list[SampleRequest]:
    """`num_prompts` requests whose input and output lengths are drawn uniformly from
    `[len * (1 - range_ratio), len * (1 + range_ratio)]` (at least 1), with random token ids. With `prefix_len`
    (vLLM's `--random-prefix-len`) every prompt starts with the same `prefix_len` random tokens, before its own.

    Without a tokenizer the prompts are token-id lists drawn from `token_id_range`, exactly as long as drawn. With
    one they are texts made of random (non-special) tokens that encode back to exactly the drawn length (with
    `add_special_tokens`: counting the BOS the tokenizer adds, as a completions or embeddings endpoint does; without:
    the text alone, as a chat message's content), as vLLM makes them: random ids decoded to text do not in general
    encode back to as many tokens, so the ids are trimmed or extended until they do (`fit_text`). Same seed, same
    requests.
    """
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    rng = random.Random(seed)
    draw = _id_drawer(rng, *token_id_range) if tokenizer is None else token_drawer(tokenizer, rng)
    prefix = draw(prefix_len)
    prefix_text = ""
    if tokenizer is not None:
        prefix_text, _ = fit_text(tokenizer, "", prefix, prefix_len, False, draw)
    requests = []
    for _ in range(num_prompts):
        num_input = _draw_length(rng, input_len, range_ratio)
        num_output = _draw_length(rng, output_len, range_ratio)
        token_ids = draw(num_input)
        if tokenizer is None:
            requests.append(SampleRequest(prefix + token_ids, prefix_len + num_input, num_output))
            continue
        text, length = fit_text(
            tokenizer, prefix_text, token_ids, prefix_len + num_input, add_special_tokens, draw
        )
        requests.append(SampleRequest(text, length, num_output))
    return requests


def fit_text(
    tokenizer: Tokenizer,
    head: str,
    token_ids: list[int],
    target_len: int,
    add_special_tokens: bool,
    draw: DrawTokens,
) -> tuple[str, int]:
    """`head` followed by the text of `token_ids`, with the ids trimmed or extended (by `draw`) until the whole
    encodes to `target_len` tokens; returns the text and the length it encodes to. That length is `target_len`
    unless `MAX_FIT_ROUNDS` rounds did not reach it (or the tokenizer's own special tokens outnumber it): then it
    is the length the text really has."""
    text, length = head, 0
    previous_length, extra_trim = -1, 0
    for _ in range(MAX_FIT_ROUNDS):
        tail = tokenizer.decode(token_ids)
        text = head + tail
        length = len(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if length == target_len:
            break
        # The tail's own encoding: ids that decode to it and count the way the tokenizer counts them.
        token_ids = tokenizer.encode(tail, add_special_tokens=False)
        if length > target_len:
            # A trim that changed nothing (a cut inside a character decodes to U+FFFD, three byte tokens, again)
            # cuts one more token next time.
            extra_trim = extra_trim + 1 if length == previous_length else 0
            keep = len(token_ids) - (length - target_len) - extra_trim
            token_ids = token_ids[: max(0, keep)]
        else:
            token_ids = token_ids + draw(target_len - length)
        previous_length = length
    return text, length


def token_drawer(tokenizer: Tokenizer, rng: random.Random) -> DrawTokens:
    """Draws of random ids of `tokenizer`'s vocabulary, special tokens left out (they decode to nothing, or to
    markup the server would read as such)."""
    special = tokenizer.all_special_ids
    allowed = [token for token in range(tokenizer.vocab_size) if token not in special]
    return lambda count: [rng.choice(allowed) for _ in range(count)]


def sharegpt_requests(
    path: Path,
    num_prompts: int,
    tokenizer: Tokenizer,
    seed: int,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """`num_prompts` requests from a ShareGPT-style JSON file (a list of `{"conversations": [{"value": ...},
    ...]}`), as vLLM samples them: conversations in an order shuffled by `seed`, each one's first turn the prompt
    and its second turn's token count the output length (or `output_len`); conversations outside vLLM's bounds
    (`SHAREGPT_*`) are skipped, and when fewer than `num_prompts` remain, kept ones are drawn again. A file that
    is not such a list, or has no usable conversation, is a ValueError naming it."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    pairs = _sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, completion in pairs:
        prompt_len = len(tokenizer.encode(prompt))
        num_output = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        if _sharegpt_keeps(prompt_len, num_output, check_output=output_len is None):
            requests.append(SampleRequest(prompt, prompt_len, num_output))
            if len(requests) == num_prompts:
                return requests
    if not requests:
        raise ValueError(
            f"{path}: no conversation has a first turn of {SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT_LEN} tokens "
            f"followed by a reply (at most {SHAREGPT_MAX_TOTAL_LEN} tokens together)"
        )
    rng = random.Random(seed)
    return requests + [rng.choice(requests) for _ in range(num_prompts - len(requests))]


def _sharegpt_pairs(path: Path) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns."""
    try:
        entries: Any = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from error
    if not isinstance(entries, list):
        raise ValueError(f'{path}: expected a JSON list of {{"conversations": [...]}} objects')
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [turn.get("value") if isinstance(turn, dict) else None for turn in turns[:2]]
        if isinstance(texts[0], str) and isinstance(texts[1], str):
            pairs.append((texts[0], texts[1]))
    return pairs


def _sharegpt_keeps(prompt_len: int, output_len: int, check_output: bool) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or (check_output and output_len < SHAREGPT_MIN_LEN):
        return False
    return (
        prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN
    )


def _id_drawer(rng: random.Random, low: int, high: int) -> DrawTokens:
    return lambda count: [rng.randrange(low, high) for _ in range(count)]


def _draw_length(rng: random.Random, length: int, range_ratio: float) -> int:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.randint(low, high)
