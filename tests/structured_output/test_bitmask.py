"""`apply_grammar_bitmask`: only the sampled rows of the grammar's requests change, matched in order."""

from __future__ import annotations

import numpy as np
import torch

from kvflow.core.sched.output import GrammarOutput
from kvflow.structured_output.bitmask import apply_grammar_bitmask

NEG_INF = float("-inf")


def test_masks_each_structured_row_in_order_and_leaves_the_rest() -> None:
    logits = torch.zeros(4, 40)
    # "a" verifies one draft (2 rows), "b" is unconstrained, "c" is a partial prefill (no row).
    row_req_ids = ["a", "a", "b", "x"]
    bitmask = np.zeros((4, 2), dtype=np.int32)
    bitmask[0, 0] = 0b101  # a, first row: tokens 0 and 2
    bitmask[1, 1] = 1  # a, second row: token 32
    bitmask[2, 0] = 1  # c: no row this step
    # x: nothing allowed, so its row is left as it is
    grammar = GrammarOutput(["a", "a", "c", "x"], bitmask)
    before = logits.clone()
    out = apply_grammar_bitmask(logits, row_req_ids, grammar)
    assert out is logits
    assert torch.isfinite(logits[0]).tolist() == [i in (0, 2) for i in range(40)]
    assert torch.isfinite(logits[1]).tolist() == [i == 32 for i in range(40)]
    assert torch.equal(logits[2], before[2]) and torch.equal(logits[3], before[3])


def test_tokens_past_the_grammars_vocabulary_are_forbidden() -> None:
    logits = torch.zeros(1, 40)
    bitmask = np.full((1, 1), -1, dtype=np.int32)  # every one of 32 tokens
    apply_grammar_bitmask(logits, ["a"], GrammarOutput(["a"], bitmask))
    assert (logits[0, :32] == 0).all() and (logits[0, 32:] == NEG_INF).all()
