"""What a structured-output backend provides, and the vocabulary and bitmask formats every backend shares.

The token bitmask (xgrammar's and llguidance's format): int32 `[rows, ceil(vocab_size / 32)]`; bit `t % 32` of word
`t // 32` of a row is 1 iff token `t` is allowed. `vocab_size` is the model's logits width (it may exceed the
tokenizer's vocabulary; ids past the tokenizer's are never allowed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.tokenizer import Tokenizer


# Whitespace characters allowed between two JSON tokens (unless `disable_any_whitespace` allows none): enough for
# JSON pretty-printed a few levels deep, and a bound on a model that would otherwise write whitespace forever.
MAX_JSON_WHITESPACE = 8


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask with every token allowed (all bits set: -1 in each int32 word)."""
    return np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


@dataclass(frozen=True)
class GrammarVocab:
    """The vocabulary grammars are compiled against.

    Either `tokenizer` (a real checkpoint's) or `token_bytes` (a synthetic vocabulary: token i is `token_bytes[i]`,
    used by the hash test model) is set. `vocab_size` is the model's logits width; `eos_token_ids` are the tokens
    that may end a constrained output, and only where the constraint is complete.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Tokenizer | None = None
    token_bytes: Sequence[bytes] | None = None


class StructuredOutputGrammar(ABC):
    """One request's matcher: the constraint's state after the tokens it accepted.

    Invariant: `num_processed_tokens` is the number of tokens accepted and not rolled back; the bitmask it fills is
    the set of tokens that may follow exactly those tokens.
    """

    num_processed_tokens: int = 0

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by `token_ids`, all or nothing: False (and no change) when one is not allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the constraint is complete and its end (EOS) was accepted, or nothing can follow."""

    def error(self) -> str | None:
        """The backend's own reason when the matcher has stopped in an error (then it allows nothing), else None."""
        return None


class StructuredOutputBackend(ABC):
    """Compiles constraints for one vocabulary. `compile` may run on any thread (the manager's pool); a compiled
    constraint is shared by every request that asks for the same one, each getting its own matcher."""

    name: ClassVar[str]

    def __init__(self, vocab: GrammarVocab) -> None:
        self.vocab = vocab

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Callable[[], StructuredOutputGrammar]:
        """Compile `params`' constraint; returns a factory of fresh matchers. ValueError naming the field if the
        constraint is invalid or unsupported by this backend."""

    @staticmethod
    @abstractmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Check the constraint's syntax without a vocabulary (the API server's check before queueing):
        ValueError naming the field (`structured_outputs.json`, `.regex`, `.grammar`, ...)."""


def json_schema_text(params: StructuredOutputsParams) -> str:
    """The `json` constraint as JSON text, with `disable_additional_properties` applied."""
    import json

    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from error
    if not isinstance(schema, dict | bool):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    if params.disable_additional_properties and isinstance(schema, dict):
        schema = _no_additional_properties(schema)
    return json.dumps(schema)


def _no_additional_properties(schema: object) -> object:
    """`schema` with `"additionalProperties": false` on every object schema that does not set it."""
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _no_additional_properties(value) for key, value in schema.items()}
    if (result.get("type") == "object" or "properties" in result) and (
        "additionalProperties" not in result
    ):
        result["additionalProperties"] = False
    return result


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar (xgrammar's / GBNF syntax) matching exactly one of `choices`."""
    import json

    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
