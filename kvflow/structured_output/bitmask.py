"""Applying a step's grammar bitmask (`GrammarOutput`) to the logits the worker samples from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.worker.sampler import forbid_tokens

if TYPE_CHECKING:
    from kvflow.core.sched.output import GrammarOutput


def apply_grammar_bitmask(
    logits: torch.Tensor, row_req_ids: list[str], grammar_output: GrammarOutput
) -> torch.Tensor:
    """Set every token a structured request's grammar forbids to -inf in `logits` (the step's sampled rows, which
    nothing reads after sampling; `row_req_ids[i]` is the request of row i), in place; returns `logits`.

    Only the rows of the grammar's requests change; other rows stay bit-identical. A request verifying d drafts
    has d + 1 rows and d + 1 bitmask rows, matched in order. A row whose bitmask allows nothing is left as it is:
    the scheduler then rejects whatever it samples, and ends that request.
    """
    sampled_index: dict[str, list[int]] = {}
    for i, req_id in enumerate(row_req_ids):
        sampled_index.setdefault(req_id, []).append(i)
    logits_rows: list[int] = []
    mask_rows: list[int] = []
    seen: dict[str, int] = {}
    for mask_row, req_id in enumerate(grammar_output.structured_output_request_ids):
        rows = sampled_index.get(req_id)
        if rows is None:  # a partial prefill samples nothing
            continue
        nth = seen.get(req_id, 0)
        seen[req_id] = nth + 1
        logits_rows.append(rows[nth])
        mask_rows.append(mask_row)
    if not logits_rows:
        return logits
    # Bit j of word w allows token 32 * w + j (little-endian words, so the bytes unpack in token order).
    # E.g., a first word 5 (0b101) allows tokens 0 and 2.
    words = np.ascontiguousarray(grammar_output.grammar_bitmask[mask_rows])
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    vocab_size = logits.shape[1]
    if bits.shape[1] < vocab_size:  # logits past the grammar's vocabulary are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    forbidden = bits[:, :vocab_size] == 0
    forbidden[~words.any(axis=1)] = False  # nothing allowed: leave the row unmasked
    mask = torch.from_numpy(forbidden).to(logits.device)
    if logits_rows == list(range(logits.shape[0])):  # every sampled row is constrained, in order
        return logits.masked_fill_(mask, float("-inf"))
    index = torch.tensor(logits_rows, dtype=torch.int64, device=logits.device)
    return forbid_tokens(logits, (index, mask))
