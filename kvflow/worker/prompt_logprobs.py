"""Prompt logprobs in the worker: which logits rows a step adds for them, and the logprobs those rows give.

A request with `SamplingParams.prompt_logprobs` adds one logits row per prompt position it computes that predicts
a prompt token, after the step's sampled rows; requests without prompt logprobs add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.core.sched.output import LogprobsLists
from kvflow.worker.sampler import token_logprobs

if TYPE_CHECKING:
    from kvflow.worker.states import RequestSlots

# Prompt-logprob rows go through log_softmax / rank / top-k this many at a time, bounding the temporaries.
PROMPT_LOGPROBS_CHUNK_ROWS = 512


@dataclass
class PromptLogprobRows:
    """The step's prompt-logprob rows, after the sampled rows in `BatchInputs.logits_indices`, grouped by request.

    Request `req_ids[i]` owns `counts[i]` consecutive rows; row j of it holds the logits at prompt position
    `start_indices[i] - 1 + j`, which predict prompt token `start_indices[i] + j` (`target_token_ids`).
    """

    req_ids: list[str]
    num_logprobs: list[int]
    start_indices: list[int]
    counts: list[int]
    flat_indices: np.ndarray  # [num_rows] flat batch token of each row
    target_token_ids: np.ndarray  # [num_rows] the prompt token each row predicts


def prompt_logprob_rows(
    pending: dict[str, int],
    slots: RequestSlots,
    req_id_to_index: dict[str, int],
    slot_indices: np.ndarray,
    start: np.ndarray,
    num_scheduled: np.ndarray,
    query_start_loc: np.ndarray,
) -> PromptLogprobRows | None:
    """The logits rows this step's prompt-logprob requests need (None if none); O(their scheduled tokens).

    `pending` maps the requests still computing prompt logprobs to their `prompt_logprobs`; batch row r
    (`req_id_to_index`) is slot `slot_indices[r]`, computing `num_scheduled[r]` positions from `start[r]`,
    whose first flat batch token is `query_start_loc[r]`. A request computing positions [first, end) needs
    the logits of those below `num_prompt_tokens - 1` (the last prompt position predicts the first output, a
    sampled row). It leaves `pending` once `end` reaches that position. E.g., a 10-token prompt in chunks of 4:
    positions 0-3 give prompt tokens 1-4, 4-7 give 5-8, and the last chunk's position 8 gives token 9 (position 9
    samples).
    """
    rows = PromptLogprobRows([], [], [], [], np.empty(0, np.int64), np.empty(0, np.int64))
    flat_parts: list[np.ndarray] = []
    target_parts: list[np.ndarray] = []
    for req_id, num_logprobs in list(pending.items()):
        row = req_id_to_index.get(req_id)
        if row is None:
            continue  # not scheduled this step
        slot = int(slot_indices[row])
        first = int(start[row])
        end = first + int(num_scheduled[row])
        last_position = int(slots.num_prompt_tokens[slot]) - 1
        if end >= last_position:
            del pending[req_id]  # complete after this step
        stop = min(end, last_position)
        if stop <= first:
            continue
        flat_parts.append(np.arange(stop - first) + query_start_loc[row])
        target_parts.append(slots.token_ids[slot, first + 1 : stop + 1])
        rows.req_ids.append(req_id)
        rows.num_logprobs.append(num_logprobs)
        rows.start_indices.append(first + 1)
        rows.counts.append(stop - first)
    if not rows.req_ids:
        return None
    rows.flat_indices = np.concatenate(flat_parts)
    rows.target_token_ids = np.concatenate(target_parts)
    return rows


def compute_prompt_logprobs(
    logits: torch.Tensor, rows: PromptLogprobRows
) -> dict[str, LogprobsLists]:
    """Each prompt-logprob request's rows: the actual prompt token, then its top `prompt_logprobs` tokens.

    `logits` are the raw float32 logits of `rows`, in order; no sampling setting (temperature, penalties) applies.
    """
    targets = torch.from_numpy(rows.target_token_ids).to(logits.device)
    num_top = max(rows.num_logprobs)
    ids: list[list[int]] = []
    values: list[list[float]] = []
    ranks: list[int] = []
    for begin in range(0, logits.shape[0], PROMPT_LOGPROBS_CHUNK_ROWS):
        end = begin + PROMPT_LOGPROBS_CHUNK_ROWS
        chunk_ids, chunk_values, chunk_ranks = token_logprobs(
            logits[begin:end], targets[begin:end], num_top
        )
        ids += chunk_ids
        values += chunk_values
        ranks += chunk_ranks
    result: dict[str, LogprobsLists] = {}
    offset = 0
    for req_id, num_logprobs, start_index, count in zip(
        rows.req_ids, rows.num_logprobs, rows.start_indices, rows.counts, strict=True
    ):
        width = 1 + num_logprobs
        result[req_id] = LogprobsLists(
            [row[:width] for row in ids[offset : offset + count]],
            [row[:width] for row in values[offset : offset + count]],
            ranks[offset : offset + count],
            start_index=start_index,
        )
        offset += count
    return result
