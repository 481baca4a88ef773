"""A speculative-decoding proposer for tests over the hash model: drafts whose accepted length is known.

The hash model's next tokens are computable from a request's tokens (`reference_tokens`), so a proposer can draft
them exactly, then spoil one: `HashOracleProposer` drafts the true continuation and replaces its token at
`len(token_ids) mod (k + 1)` (no replacement when that is k), so successive steps see every accepted length from 0
to k, deterministically. Registered (for tests only) as `SPEC_PROPOSERS` method "hash-oracle" by
`register_hash_oracle()`; the engine verifies its drafts like any others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.models.hash_model import DEFAULT_VOCAB_SIZE, reference_tokens
from kvflow.spec_decode.proposer import LookupProposer

if TYPE_CHECKING:
    import numpy as np

    from kvflow.config import SpeculativeConfig

HASH_ORACLE_METHOD = "hash-oracle"


class HashOracleProposer(LookupProposer):
    """Drafts the hash model's own continuation with one token spoiled (see the module docstring).

    Invariant: for a request of n known tokens, the first `n mod (k + 1)` drafts are the model's next tokens and
    the next one (if any) is not, so exactly that many are accepted when drafts are verified in order."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        k = min(self.num_speculative_tokens, max_drafts)
        tokens = [int(token) for token in token_ids]
        drafts = reference_tokens(tokens, k)
        spoiled = len(tokens) % (self.num_speculative_tokens + 1)
        if spoiled < k:
            drafts[spoiled] = (drafts[spoiled] + 1) % DEFAULT_VOCAB_SIZE
        return drafts


def register_hash_oracle() -> None:
    """Make "hash-oracle" a `speculative_config` method (idempotent)."""
    from kvflow.spec_decode import SPEC_PROPOSERS

    SPEC_PROPOSERS.register(HASH_ORACLE_METHOD, f"{__name__}:HashOracleProposer")
