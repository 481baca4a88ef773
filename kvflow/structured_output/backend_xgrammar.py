"""The xgrammar backend (the default): constraints compiled by `xgrammar.GrammarCompiler`, one `GrammarMatcher` per
request."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import xgrammar as xgr

from kvflow.structured_output.backend import (
    MAX_JSON_WHITESPACE,
    GrammarVocab,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    choice_ebnf,
    json_schema_text,
)

if TYPE_CHECKING:
    from kvflow.sampling_params import StructuredOutputsParams


class XgrammarGrammar(StructuredOutputGrammar):
    """An `xgrammar.GrammarMatcher` (see `StructuredOutputGrammar` for the invariant)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_processed_tokens = 0

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for accepted, token_id in enumerate(token_ids):
            if not self.matcher.accept_token(token_id):
                self.matcher.rollback(accepted)
                return False
        self.num_processed_tokens += len(token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """Compiles with one `GrammarCompiler` over the engine's vocabulary. Its own cache is off: the manager's
    (bounded, keyed by constraint) is the one cache, so a stream of distinct constraints cannot grow the engine
    (xgrammar's cache is unbounded by default: ~1 MB of RSS per 4,096-alternative regex, kept forever)."""

    name = "xgrammar"

    def __init__(self, vocab: GrammarVocab) -> None:
        super().__init__(vocab)
        self.compiler = xgr.GrammarCompiler(
            _tokenizer_info(vocab), max_threads=2, cache_enabled=False
        )

    def compile(self, params: StructuredOutputsParams) -> Callable[[], StructuredOutputGrammar]:
        compiled = _compile_checked(self.compiler, params)
        return lambda: XgrammarGrammar(compiled)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        _compile_checked(None, params)


def _compile_checked(
    compiler: xgr.GrammarCompiler | None, params: StructuredOutputsParams
) -> xgr.CompiledGrammar | xgr.Grammar:
    """Compile (or, without a compiler, only parse) `params`' constraint; ValueError naming the field."""
    kind = params.kind
    try:
        if kind == "json":
            schema = json_schema_text(params)
            unenforced = unenforced_keyword(json.loads(schema))
            if unenforced is not None:
                raise ValueError(
                    f"structured_outputs.json uses {unenforced}, which the xgrammar backend does not enforce "
                    "(with backend 'auto' such a schema goes to guidance)"
                )
            options = _json_options(params)
            if compiler is None:
                return xgr.Grammar.from_json_schema(schema, **options)
            return compiler.compile_json_schema(schema, **options)
        if kind == "json_object":
            # Any JSON object, with the same whitespace rule as a schema's.
            schema = '{"type": "object"}'
            options = _json_options(params)
            if compiler is None:
                return xgr.Grammar.from_json_schema(schema, **options)
            return compiler.compile_json_schema(schema, **options)
        if kind == "regex":
            if compiler is None:
                return xgr.Grammar.from_regex(params.regex)
            return compiler.compile_regex(params.regex)
        if kind in ("grammar", "choice"):
            ebnf = params.grammar if kind == "grammar" else choice_ebnf(params.choice or [])
            grammar = xgr.Grammar.from_ebnf(ebnf)
            return grammar if compiler is None else compiler.compile_grammar(grammar)
        if kind == "structural_tag":
            if compiler is None:
                return xgr.Grammar.from_structural_tag(params.structural_tag)
            return compiler.compile_structural_tag(params.structural_tag)
    except ValueError as error:
        if str(error).startswith("structured_outputs."):
            raise
        raise ValueError(f"structured_outputs.{kind} is invalid: {_first_line(error)}") from error
    except RuntimeError as error:
        raise ValueError(f"structured_outputs.{kind} is invalid: {_first_line(error)}") from error
    raise ValueError(f"structured_outputs.{kind} is not supported by the xgrammar backend")


# JSON-schema keywords xgrammar 0.2 accepts but does not enforce (for each, xgrammar's grammar accepts a value that
# violates it; `allOf` only with two or more subschemas): a schema using one is refused rather than half-honoured.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired")
# Where a schema holds subschemas: a map of names to subschemas, a list of them, or one.
_SUBSCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SUBSCHEMAS = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "contains",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
        "not",
        "if",
        "then",
        "else",
    }
)


def unenforced_keyword(schema: object, path: str = "#") -> str | None:
    """The first keyword of `UNENFORCED_KEYWORDS` (or an `allOf` of several subschemas) in `schema` or any of its
    subschemas, as "'keyword' at <JSON pointer>"; None when xgrammar enforces the whole schema. Values (`const`,
    `enum`, `default`, property names) are not searched: a property named "not" is no keyword."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            return f"{keyword!r} at {path}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"'allOf' of {len(all_of)} subschemas at {path}"
    for subschema, subpath in _subschemas(schema, path):
        found = unenforced_keyword(subschema, subpath)
        if found is not None:
            return found
    return None


def _subschemas(schema: dict[str, object], path: str) -> Iterator[tuple[object, str]]:
    """Each subschema of `schema` (one level down) with its JSON pointer."""
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            yield from ((sub, f"{path}/{key}/{name}") for name, sub in value.items())
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            yield from ((sub, f"{path}/{key}/{index}") for index, sub in enumerate(value))
        elif key in _SUBSCHEMAS:
            yield value, f"{path}/{key}"


def _json_options(params: StructuredOutputsParams) -> dict[str, object]:
    """Compact JSON with `disable_any_whitespace`, else at most MAX_JSON_WHITESPACE characters per gap."""
    if params.disable_any_whitespace:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _first_line(error: BaseException) -> str:
    """xgrammar's message without its `[time] file:line:` prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(" ")[0]:
            text = text.split(": ", 1)[-1]
    return text


def _tokenizer_info(vocab: GrammarVocab) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it: a real tokenizer through transformers' fast-tokenizer wrapper (which
    xgrammar reads the vocabulary type and prefix-space handling from), a synthetic one as raw byte strings."""
    stop_token_ids = [t for t in vocab.eos_token_ids if t < vocab.vocab_size] or None
    if vocab.tokenizer is not None:
        from transformers import PreTrainedTokenizerFast

        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab.tokenizer.backend)
        return xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab.vocab_size, stop_token_ids=stop_token_ids
        )
    assert vocab.token_bytes is not None, "a GrammarVocab needs a tokenizer or token_bytes"
    return xgr.TokenizerInfo(
        list(vocab.token_bytes),
        xgr.VocabType.RAW,
        vocab_size=vocab.vocab_size,
        stop_token_ids=stop_token_ids,
    )
