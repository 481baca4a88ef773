"""The hash model, re-exported for tests: it lives in `kvflow.models.hash_model` (a model like any other), and
tests inside and outside this repository import it from here as the oracle."""

from __future__ import annotations

from kvflow.models.hash_model import (
    BASE,
    DEFAULT_EOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    MODULUS,
    MULTIPLIER,
    HashModel,
    hash_tokens,
    next_token,
    next_token_from_hash,
    reference_tokens,
)

__all__ = [
    "BASE",
    "DEFAULT_EOS_TOKEN_ID",
    "DEFAULT_VOCAB_SIZE",
    "MODULUS",
    "MULTIPLIER",
    "HashModel",
    "hash_tokens",
    "next_token",
    "next_token_from_hash",
    "reference_tokens",
]
