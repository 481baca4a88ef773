"""The batched sampler: turns one step's logits into one token per sampled row (vLLM V1 semantics).

Order of operations, per row, all as batched tensor ops:
  1. raw logprobs (when any row asks): `log_softmax` of the logits as given, in float32;
  2. min_tokens: while a row has fewer than `min_tokens` outputs, its EOS and stop token ids are set to -inf;
  3. logits controls, only on the rows that set them: `allowed_token_ids` (every other id -> -inf), bad words
     (a bad word's last token -> -inf where the row's outputs end with the rest of the word) and `logit_bias`
     (added to the listed ids);
  4. penalties: repetition (prompt and outputs), frequency and presence (outputs only);
  5. greedy rows (temperature ~ 0) take the argmax here;
  6. random rows: divide by temperature, then min-p, top-k, top-p, and sample with the exponential race
     `argmax(probs / q)`, `q ~ Exp(1)`, each row's `q` drawn from its own seeded generator or the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.core.sched.output import LogprobsLists
from kvflow.utils import to_device

if TYPE_CHECKING:
    from kvflow.sampling_params import SamplingParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS); dividing by them would overflow float32.
_SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class PenaltyMetadata:
    """Penalty settings and token statistics for the rows that use a penalty (`m` rows, `m <= n`).

    Invariants: every tensor's first dimension is `m` and is indexed like `rows`; a row's unused penalties hold
    their neutral value (repetition 1, frequency 0, presence 0); `prompt_mask[i, t]` is True iff token `t` is
    in row `rows[i]`'s prompt, `output_counts[i, t]` how often `t` occurs in its outputs so far.
    """

    rows: torch.Tensor  # int64 [m]: batch rows
    repetition_penalties: torch.Tensor  # float32 [m]
    frequency_penalties: torch.Tensor  # float32 [m]
    presence_penalties: torch.Tensor  # float32 [m]
    prompt_mask: torch.Tensor  # bool [m, vocab]
    output_counts: torch.Tensor  # float32 [m, vocab]


@dataclass
class SamplingMetadata:
    """One step's per-row sampling settings as tensors; row `i` is the batch's `i`-th sampled row.

    Invariants:
      * per-row tensors have `num_rows` entries and live on one device;
      * `all_greedy` / `all_random` say whether every row is greedy / random (both True only when `num_rows == 0`);
        greedy rows hold temperature 1.0 (never divided by 0) and neutral top-k / top-p / min-p values;
      * `top_k`, `top_p`, `min_p` are None when no random row uses them; otherwise rows without the feature hold
        the neutral value (`top_k = vocab_size`, `top_p = 1.0`, `min_p = 0.0`);
      * `penalties` is None when no row uses a penalty; `min_tokens_mask` is None when no row is below its
        `min_tokens`, else `(rows, token_ids)` int64 index pairs to set to -inf;
      * `allowed_token_mask` is None when no row sets `allowed_token_ids`, else `(rows, mask)`: int64 rows `[a]`
        and a bool `[a, vocab]` mask, True where the row may not sample the token;
      * `bad_words_mask` is None when no row's outputs end with a bad word's prefix, else `(rows, token_ids)`
        int64 index pairs (each pair once) to set to -inf; `logit_bias` is None when no row sets one, else
        `(rows, token_ids, biases)`, int64, int64 and float32, each (row, token id) pair once;
      * the three controls hold only in-vocabulary ids and only the rows that set them;
      * `generators` maps each random row with a seed to a generator seeded from (seed, output position) alone,
        created for this step only, so no random state survives a step (or a preemption);
      * `num_logprobs[i]` is row `i`'s `SamplingParams.logprobs`; `logprob_rows` the rows where it is not None and
        `max_num_logprobs` their maximum (None when `logprob_rows` is empty).
    """

    num_rows: int
    temperature: torch.Tensor  # float32 [n]
    greedy: torch.Tensor  # bool [n]
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # int64 [n]
    top_p: torch.Tensor | None = None  # float32 [n]
    min_p: torch.Tensor | None = None  # float32 [n]
    penalties: PenaltyMetadata | None = None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed_token_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_words_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_logprobs: list[int | None] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    max_num_logprobs: int | None = None

    @property
    def has_logits_processing(self) -> bool:
        """Some row has something to apply to its logits before temperature (min_tokens, controls, penalties)."""
        return not (
            self.min_tokens_mask is None
            and self.allowed_token_mask is None
            and self.bad_words_mask is None
            and self.logit_bias is None
            and self.penalties is None
        )

    @property
    def is_plain_greedy(self) -> bool:
        """All rows greedy with nothing to apply before the argmax and no logprobs: the argmax-only fast path."""
        return self.all_greedy and not self.has_logits_processing and self.max_num_logprobs is None


@dataclass
class SamplerOutput:
    """One token per sampled row and, when any row asked, its logprobs (`LogprobsLists` rows indexed likewise)."""

    sampled_token_ids: torch.Tensor  # int64 [n]
    logprobs: LogprobsLists | None


# ---------------------------------------------------------------------------------------------- metadata
def build_sampling_metadata(
    params: Sequence[SamplingParams],
    *,
    token_ids: np.ndarray,
    slot_indices: np.ndarray,
    num_prompt_tokens: np.ndarray,
    num_tokens: np.ndarray,
    vocab_size: int,
    eos_token_id: int | None,
    device: torch.device,
) -> SamplingMetadata:
    """Collect the sampled rows' settings into tensors on `device`.

    `token_ids` is the runner's whole token array; only the penalty rows' histories and the bad-word rows' last
    outputs are read from it. The cost is O(rows) plus O(history of the rows that use penalties) plus O(size of
    the controls) for the rows that set `allowed_token_ids`, `bad_words_token_ids` or `logit_bias`.
    """
    num_rows = len(params)
    positions = np.asarray(num_tokens, dtype=np.int64) - np.asarray(
        num_prompt_tokens, dtype=np.int64
    )
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    greedy = _is_greedy(temperature)
    random_rows = ~greedy
    metadata = SamplingMetadata(
        num_rows=num_rows,
        temperature=to_device(np.where(greedy, np.float32(1.0), temperature), device),
        greedy=to_device(greedy, device),
        all_greedy=not bool(random_rows.any()),
        all_random=bool(random_rows.all()),
        num_logprobs=[p.logprobs for p in params],
    )
    _fill_truncation(metadata, params, random_rows, vocab_size, device)
    metadata.penalties = _build_penalties(
        params,
        token_ids,
        np.asarray(slot_indices, dtype=np.int64),
        np.asarray(num_prompt_tokens, dtype=np.int64),
        np.asarray(num_tokens, dtype=np.int64),
        vocab_size,
        device,
    )
    metadata.min_tokens_mask = _build_min_tokens_mask(
        params, positions, vocab_size, eos_token_id, device
    )
    _fill_logits_controls(
        metadata, params, token_ids, slot_indices, num_tokens, positions, vocab_size, device
    )
    for row in np.flatnonzero(random_rows).tolist():
        seed = params[row].seed
        if seed is not None:
            metadata.generators[row] = _seeded_generator(seed, int(positions[row]), device)
    metadata.logprob_rows = [row for row, k in enumerate(metadata.num_logprobs) if k is not None]
    metadata.max_num_logprobs = max(
        (k for k in metadata.num_logprobs if k is not None), default=None
    )
    return metadata


def _is_greedy(temperature: np.ndarray | np.float32) -> np.ndarray | np.bool_:
    """Whether a float32 temperature is greedy (one rule for `build_sampling_metadata` and `samples_argmax_only`)."""
    return temperature < _SAMPLING_EPS


def samples_argmax_only(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row of a request with `params` and `num_output_tokens` outputs so far takes the plain argmax of
    its logits: greedy, no logprobs, and nothing `build_sampling_metadata` would apply before the argmax.

    Never True where `build_sampling_metadata(...).is_plain_greedy` would be False (a conservative check: it may
    say False for settings that turn out to change nothing, such as a `min_tokens` ban on ids outside the
    vocabulary), so a batch of such rows can skip building the metadata: O(1) per row, no tensors.
    """
    return bool(
        _is_greedy(np.float32(params.temperature))
        and params.logprobs is None
        and num_output_tokens >= params.min_tokens
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and not params.allowed_token_ids
        and not params.bad_words_token_ids
        and not params.logit_bias
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (int64), the first maximum, NaN counting as the maximum (as `torch.argmax`).

    A CPU float32 tensor goes through numpy's vectorised argmax, an order of magnitude faster than torch's for
    vocabulary-sized rows (about 10 us against 110 us for 128256 logits on a Zen 4 core), with the same result.
    """
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and not logits.requires_grad
    ):
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def _fill_truncation(
    metadata: SamplingMetadata,
    params: Sequence[SamplingParams],
    random_rows: np.ndarray,
    vocab_size: int,
    device: torch.device,
) -> None:
    """Set top-k / top-p / min-p tensors when some random row uses them (neutral values elsewhere)."""
    top_k = np.array([p.top_k for p in params], dtype=np.int64)
    top_k = np.where(random_rows & (top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    top_p = np.where(
        random_rows, np.array([p.top_p for p in params], dtype=np.float32), np.float32(1.0)
    )
    min_p = np.where(
        random_rows, np.array([p.min_p for p in params], dtype=np.float32), np.float32(0.0)
    )
    if (top_k < vocab_size).any():
        metadata.top_k = to_device(top_k, device)
    if (top_p < 1.0).any():
        metadata.top_p = to_device(top_p.astype(np.float32), device)
    if (min_p > 0.0).any():
        metadata.min_p = to_device(min_p.astype(np.float32), device)


def _build_penalties(
    params: Sequence[SamplingParams],
    token_ids: np.ndarray,
    slot_indices: np.ndarray,
    num_prompt_tokens: np.ndarray,
    num_tokens: np.ndarray,
    vocab_size: int,
    device: torch.device,
) -> PenaltyMetadata | None:
    """Prompt masks and output counts for the rows with a penalty, by padded gathers and one scatter each."""
    repetition = np.array([p.repetition_penalty for p in params], dtype=np.float32)
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)
    rows = np.flatnonzero((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0))
    if rows.size == 0:
        return None
    slots, prompt_lens = slot_indices[rows], num_prompt_tokens[rows]
    prompt_ids = _gather_padded(
        token_ids, slots, np.zeros_like(prompt_lens), prompt_lens, vocab_size
    )
    output_ids = _gather_padded(
        token_ids, slots, prompt_lens, num_tokens[rows] - prompt_lens, vocab_size
    )
    # Column `vocab_size` collects the padding and is sliced off.
    prompt_mask = torch.zeros(rows.size, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, to_device(prompt_ids, device), True)
    output_index = to_device(output_ids, device)
    output_counts = torch.zeros(rows.size, vocab_size + 1, dtype=torch.float32, device=device)
    output_counts.scatter_add_(
        1, output_index, torch.ones(output_index.shape, dtype=torch.float32, device=device)
    )
    return PenaltyMetadata(
        rows=to_device(rows.astype(np.int64), device),
        repetition_penalties=to_device(repetition[rows], device),
        frequency_penalties=to_device(frequency[rows], device),
        presence_penalties=to_device(presence[rows], device),
        prompt_mask=prompt_mask[:, :vocab_size],
        output_counts=output_counts[:, :vocab_size],
    )


def _gather_padded(
    token_ids: np.ndarray, slots: np.ndarray, starts: np.ndarray, lengths: np.ndarray, pad_id: int
) -> np.ndarray:
    """`token_ids[slot, start:start + length]` per row as one `[rows, max length]` array padded with `pad_id`.

    Ids outside `[0, pad_id)` (the vocabulary) are replaced by `pad_id` too. The caller scatters the result into
    `pad_id + 1` columns and drops the last, so padding never counts as a token; one gather serves every row,
    whatever its length.

    E.g., slot 4 holds [11, 12, 13, 40, 41] and slot 1 holds [7, 8, 50], prompts of 3 and 2 tokens, pad_id 100:
    the prompts (starts [0, 0], lengths [3, 2]) -> [[11, 12, 13], [7, 8, 100]] and the outputs
    (starts [3, 2], lengths [2, 1]) -> [[40, 41], [50, 100]].
    """
    # The widest row sets the width; shorter rows read past their end and are masked below.
    # E.g., lengths [2, 1] -> width 2, offsets [0, 1]
    width = int(lengths.max()) if lengths.size else 0
    offsets = np.arange(width, dtype=np.int64)
    # Each row's column range, clamped to the array so a padding read near max_model_len stays in bounds.
    # E.g., starts [3, 2] -> [[3, 4], [2, 3]]
    columns = np.minimum(starts[:, None] + offsets[None, :], token_ids.shape[1] - 1)
    # E.g., -> [[40, 41], [50, <stale>]]
    ids = token_ids[slots[:, None], columns]
    # E.g., offsets < lengths -> [[True, True], [True, False]] -> [[40, 41], [50, 100]]
    valid = (offsets[None, :] < lengths[:, None]) & (ids >= 0) & (ids < pad_id)
    return np.where(valid, ids, pad_id).astype(np.int64)


def _build_min_tokens_mask(
    params: Sequence[SamplingParams],
    positions: np.ndarray,
    vocab_size: int,
    eos_token_id: int | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of the EOS and stop tokens of rows that have not yet produced `min_tokens` outputs."""
    rows: list[int] = []
    banned: list[int] = []
    for row, p in enumerate(params):
        if positions[row] >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids or ())
        if eos_token_id is not None:
            stop_ids.add(eos_token_id)
        for token_id in sorted(stop_ids):
            if 0 <= token_id < vocab_size:
                rows.append(row)
                banned.append(token_id)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(banned, dtype=torch.int64, device=device),
    )


def _fill_logits_controls(
    metadata: SamplingMetadata,
    params: Sequence[SamplingParams],
    token_ids: np.ndarray,
    slot_indices: np.ndarray,
    num_tokens: np.ndarray,
    positions: np.ndarray,
    vocab_size: int,
    device: torch.device,
) -> None:
    """Set the allowed-token mask, the bad-word bans and the logit biases of the rows that use them.

    Ids outside the vocabulary are dropped (the engine refuses them before a request is queued). A bad word
    bans its last token where the row's outputs (never its prompt) end with the word's other tokens; a one-token
    word is banned at every step. E.g., outputs [.., 7, 8] and bad words [[8, 9], [5, 8, 9], [4]] ban 9 and 4.
    """
    allowed_rows: list[int] = []
    allowed_ids: list[list[int]] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for row, p in enumerate(params):
        if p.allowed_token_ids:
            allowed_rows.append(row)
            allowed_ids.append([t for t in p.allowed_token_ids if 0 <= t < vocab_size])
        if p.bad_words_token_ids:
            for token_id in _bad_word_bans(
                p.bad_words_token_ids,
                token_ids[int(slot_indices[row])],
                int(num_tokens[row]),
                int(positions[row]),
                vocab_size,
            ):
                banned_rows.append(row)
                banned_ids.append(token_id)
        if p.logit_bias:
            for token_id, bias in p.logit_bias.items():
                if 0 <= token_id < vocab_size:
                    bias_rows.append(row)
                    bias_ids.append(token_id)
                    bias_values.append(bias)
    if allowed_rows:
        # Column `vocab_size` absorbs the padding of rows with fewer allowed ids and is sliced off.
        width = max(len(ids) for ids in allowed_ids)
        padded = np.full((len(allowed_rows), width), vocab_size, dtype=np.int64)
        for i, ids in enumerate(allowed_ids):
            padded[i, : len(ids)] = ids
        mask = torch.ones(len(allowed_rows), vocab_size + 1, dtype=torch.bool, device=device)
        mask.scatter_(1, to_device(padded, device), False)
        metadata.allowed_token_mask = (
            torch.tensor(allowed_rows, dtype=torch.int64, device=device),
            mask[:, :vocab_size],
        )
    if banned_rows:
        metadata.bad_words_mask = (
            torch.tensor(banned_rows, dtype=torch.int64, device=device),
            torch.tensor(banned_ids, dtype=torch.int64, device=device),
        )
    if bias_rows:
        metadata.logit_bias = (
            torch.tensor(bias_rows, dtype=torch.int64, device=device),
            torch.tensor(bias_ids, dtype=torch.int64, device=device),
            torch.tensor(bias_values, dtype=torch.float32, device=device),
        )


def _bad_word_bans(
    bad_words_token_ids: Sequence[Sequence[int]],
    history: np.ndarray,
    num_tokens: int,
    num_outputs: int,
    vocab_size: int,
) -> list[int]:
    """The sorted last tokens of the bad words whose other tokens end the row's outputs.

    `history` is the row's token buffer: `num_tokens` tokens, the last `num_outputs` of them outputs. Only the
    last `longest prefix` outputs are read.
    """
    longest_prefix = max((len(word) - 1 for word in bad_words_token_ids), default=0)
    tail_len = min(longest_prefix, num_outputs)
    tail = history[num_tokens - tail_len : num_tokens].tolist() if tail_len > 0 else []
    banned: set[int] = set()
    for word in bad_words_token_ids:
        if not word:
            continue
        prefix_len = len(word) - 1
        last = word[-1]
        if not 0 <= last < vocab_size or prefix_len > tail_len:
            continue
        if prefix_len == 0 or tail[tail_len - prefix_len :] == list(word[:-1]):
            banned.add(last)
    return sorted(banned)


def _seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A fresh generator whose state is a function of (seed, output position) only."""
    generator = torch.Generator(device=device)
    generator.manual_seed(mix_seed(seed, position))
    return generator


def mix_seed(seed: int, position: int) -> int:
    """A 64-bit seed from (request seed, output position): splitmix64(splitmix64(seed) ^ position).

    Both steps are bijections on 64-bit ints, so for a fixed seed every position gets a distinct value.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


# ---------------------------------------------------------------------------------------------- logits processing
def ban_token_pairs(
    logits: torch.Tensor, banned: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Set each (row, token id) pair of `banned` to -inf, in place; returns `logits` (min_tokens' EOS and stop
    ids, bad words' last tokens)."""
    rows, token_ids = banned
    logits[rows, token_ids] = float("-inf")
    return logits


def forbid_tokens(
    logits: torch.Tensor, forbidden: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Set every token a row may not sample (mask True) to -inf, on the mask's rows only, in place; returns
    `logits` (`allowed_token_ids`' complement here, a grammar's bitmask in the runner)."""
    rows, mask = forbidden
    logits[rows] = logits[rows].masked_fill_(mask, float("-inf"))
    return logits


def apply_logit_bias(
    logits: torch.Tensor, logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Add each (row, token id)'s bias, in place (pairs are distinct, so no update is lost); returns `logits`."""
    rows, token_ids, biases = logit_bias
    logits[rows, token_ids] += biases
    return logits


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties to `penalties.rows`, in place; returns `logits`.

    Repetition (HF / vLLM): a token seen in the prompt or the outputs has a positive logit divided by the
    penalty, a non-positive one multiplied. Then `logit -= frequency * count + presence * (count > 0)`.
    """
    rows = penalties.rows
    row_logits = logits[rows]
    output_mask = penalties.output_counts > 0
    seen = penalties.prompt_mask | output_mask
    repetition = torch.where(seen, penalties.repetition_penalties[:, None], 1.0)
    row_logits = torch.where(row_logits > 0, row_logits / repetition, row_logits * repetition)
    row_logits -= penalties.frequency_penalties[:, None] * penalties.output_counts
    row_logits -= penalties.presence_penalties[:, None] * output_mask
    logits[rows] = row_logits
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p * max probability`, in place; returns `logits`.

    Computed in log space: `logit < max logit + log(min_p)`; `min_p = 0` gives `-inf`, which drops nothing.
    """
    threshold = logits.amax(dim=-1) + torch.log(min_p)
    return logits.masked_fill_(logits < threshold[:, None], float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's `top_k` most likely tokens, then the smallest prefix of those with mass >= `top_p`.

    In place; returns `logits`. Top-p is measured on the distribution renormalised after top-k (vLLM). Ties at
    the boundary are broken by sort order, so exactly `top_k` tokens survive top-k. The most likely token always
    survives; rows with `top_k = vocab` and `top_p = 1` are untouched.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    vocab_positions = torch.arange(logits.shape[-1], device=logits.device)
    drop = torch.zeros(sorted_logits.shape, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        drop |= vocab_positions[None, :] >= top_k[:, None]
        sorted_logits.masked_fill_(drop, float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows with top_p = 1 must not lose tail tokens to cumsum rounding: their threshold is +inf.
        threshold = torch.where(top_p < 1.0, top_p, float("inf"))
        drop |= mass_before >= threshold[:, None]
    drop[:, 0] = False
    return logits.masked_fill_(drop.scatter(1, sorted_ids, drop), float("-inf"))


# ---------------------------------------------------------------------------------------------- sampler
class Sampler:
    """Samples one token per row from float32 logits `[n, vocab]` according to a `SamplingMetadata`.

    Invariants: the caller's logits are never modified; a seeded row's token depends only on its logits, its
    settings and (seed, output position), never on the rest of the batch; unseeded random rows draw from this
    sampler's own generator (one per device, seeded with `seed`), so a run is reproducible for a fixed schedule.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_rows, (
            f"logits {tuple(logits.shape)} do not match {metadata.num_rows} sampled rows"
        )
        if metadata.num_rows == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=logits.device), None)
        logits = logits.float()
        if metadata.is_plain_greedy:
            return SamplerOutput(argmax_rows(logits), None)
        processed = self.process_logits(logits, metadata)
        if metadata.all_greedy:
            sampled = argmax_rows(processed)
        elif metadata.all_random:
            sampled = self._sample_random(processed, metadata)
        else:
            greedy_ids = argmax_rows(processed)
            sampled = torch.where(
                metadata.greedy, greedy_ids, self._sample_random(processed, metadata)
            )
        logprobs = (
            None
            if metadata.max_num_logprobs is None
            else compute_logprobs(logits, sampled, metadata)
        )
        return SamplerOutput(sampled, logprobs)

    @staticmethod
    def argmax_only(logits: torch.Tensor) -> SamplerOutput:
        """What `__call__` returns for rows that all take the plain argmax (`samples_argmax_only` of each),
        without their `SamplingMetadata`."""
        assert logits.dim() == 2, f"logits {tuple(logits.shape)} are not [rows, vocab]"
        return SamplerOutput(argmax_rows(logits.float()), None)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """min_tokens masking, allowed_token_ids, bad words, logit_bias, then penalties, on a copy: the logits
        greedy rows take the argmax of. Rows that use none of them keep their logits bit for bit."""
        if not metadata.has_logits_processing:
            return logits
        processed = logits.clone()
        if metadata.min_tokens_mask is not None:
            ban_token_pairs(processed, metadata.min_tokens_mask)
        if metadata.allowed_token_mask is not None:
            forbid_tokens(processed, metadata.allowed_token_mask)
        if metadata.bad_words_mask is not None:
            ban_token_pairs(processed, metadata.bad_words_mask)
        if metadata.logit_bias is not None:
            apply_logit_bias(processed, metadata.logit_bias)
        if metadata.penalties is not None:
            apply_penalties(processed, metadata.penalties)
        return processed

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The exponential race over `random_probs`; greedy rows' results are discarded."""
        probs = self.random_probs(logits, metadata)
        return probs.div_(self._exponential_noise(probs, metadata)).argmax(dim=-1)

    @staticmethod
    def random_probs(processed: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row samples from: temperature, min-p, top-k / top-p over the processed
        logits, then softmax (a new tensor)."""
        scaled = processed / metadata.temperature[:, None]
        if metadata.min_p is not None:
            apply_min_p(scaled, metadata.min_p)
        apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
        return scaled.softmax(dim=-1)

    @classmethod
    def probabilities(cls, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Each row's sampling distribution `[n, vocab]` (float32): what `__call__` draws the row's token from,
        a point mass on the argmax for greedy rows (speculative decoding's target distribution)."""
        processed = cls.process_logits(logits.float(), metadata)
        greedy_ids = processed.argmax(dim=-1)
        one_hot = torch.zeros_like(processed).scatter_(1, greedy_ids[:, None], 1.0)
        if metadata.all_greedy:
            return one_hot
        probs = cls.random_probs(processed, metadata)
        if metadata.all_random:
            return probs
        return torch.where(metadata.greedy[:, None], one_hot, probs)

    def _exponential_noise(self, probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """`Exp(1)` noise shaped like `probs`: seeded rows from their own generators, the rest in one call."""
        noise = torch.empty_like(probs)
        if len(metadata.generators) < metadata.num_rows:
            noise.exponential_(generator=self.generator(probs.device))
        for row, generator in metadata.generators.items():
            noise[row].exponential_(generator=generator)
        # An exact 0 would turn a masked token's 0 / 0 into NaN, which argmax would pick.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def generator(self, device: torch.device) -> torch.Generator:
        """This sampler's own random stream on `device` (unseeded rows), created on first use from `seed`."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def compute_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, metadata: SamplingMetadata
) -> LogprobsLists:
    """The sampled token's logprob, then the top-`logprobs` tokens, from `log_softmax(raw_logits)` (float32).

    `sampled_token_ranks` holds the 1-based rank of the sampled token (1 + the number of tokens with a strictly
    higher logprob). Rows that did not ask get empty lists and rank -1.
    """
    rows = metadata.logprob_rows
    assert metadata.max_num_logprobs is not None and rows, "no row asked for logprobs"
    if len(rows) == metadata.num_rows:
        row_logits, row_sampled = raw_logits, sampled
    else:
        row_index = torch.tensor(rows, dtype=torch.int64, device=raw_logits.device)
        row_logits, row_sampled = raw_logits[row_index], sampled[row_index]
    ids_list, values_list, ranks_list = token_logprobs(
        row_logits, row_sampled, metadata.max_num_logprobs
    )
    result = LogprobsLists(
        [[] for _ in range(metadata.num_rows)],
        [[] for _ in range(metadata.num_rows)],
        [-1] * metadata.num_rows,
    )
    for i, row in enumerate(rows):
        width = 1 + metadata.num_logprobs[row]  # type: ignore[operator]
        result.logprob_token_ids[row] = ids_list[i][:width]
        result.logprobs[row] = values_list[i][:width]
        result.sampled_token_ranks[row] = ranks_list[i]
    return result


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Per row of `logits` `[n, vocab]`: `[token, top-1, ..., top-num_top]` ids, their logprobs, and the token's rank.

    Logprobs are `log_softmax(logits)` in float32; `token_ids[i]` is row i's actual token (sampled, or the next
    prompt token), and its rank is 1 + the number of tokens with a strictly higher logprob. The top tokens come in
    descending order (`num_top` is capped at the vocabulary size), so the j-th of them has rank j.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    token_logprob = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > token_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    ids = torch.cat([token_ids[:, None], top_ids], dim=1).tolist()
    values = torch.cat([token_logprob, top_logprobs], dim=1).tolist()
    return ids, values, ranks.tolist()
