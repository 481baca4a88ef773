"""The guidance backend: constraints compiled by `llguidance` (Lark grammars, GBNF, JSON schema, regex), one
`LLMatcher` per request."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import numpy as np

from kvflow.structured_output.backend import (
    MAX_JSON_WHITESPACE,
    GrammarVocab,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    json_schema_text,
)

if TYPE_CHECKING:
    from kvflow.sampling_params import StructuredOutputsParams


class GuidanceGrammar(StructuredOutputGrammar):
    """An `llguidance.LLMatcher` (see `StructuredOutputGrammar` for the invariant)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_processed_tokens = 0
        # llguidance stops as soon as nothing can extend the output (e.g. after the last choice's last token);
        # the request ends only with the EOS that follows, which the stopped matcher allows but cannot consume.
        self._eos_after_stop = False

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        consumed = 0  # tokens the matcher consumed (an EOS after a stop is not one of them)
        eos_after_stop = self._eos_after_stop
        for token_id in token_ids:
            if eos_after_stop or self.matcher.is_error():
                break
            if self.matcher.is_stopped():
                if token_id not in self.eos_token_ids:
                    break
                eos_after_stop = True
            elif self.matcher.validate_tokens([token_id]) == 1 and self.matcher.consume_tokens(
                [token_id]
            ):
                consumed += 1
            else:
                break
        else:
            self._eos_after_stop = eos_after_stop
            self.num_processed_tokens += len(token_ids)
            return True
        if consumed:  # all or nothing
            self.matcher.rollback(consumed)
        return False

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._eos_after_stop:
            self._eos_after_stop = False
            num_tokens -= 1
            self.num_processed_tokens -= 1
        if num_tokens:
            self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)

    def error(self) -> str | None:
        """llguidance's error, its first line (the rest is the parser's state dump)."""
        if not self.matcher.is_error():
            return None
        text = self.matcher.get_error().strip()
        return text.splitlines()[0] if text else "the matcher stopped in an error"

    def is_terminated(self) -> bool:
        """Ended by an accepted EOS (a stop without it still lets EOS through, and only it)."""
        return self._eos_after_stop or (
            self.matcher.is_stopped() and self.matcher.stop_reason() == "EndOfSentence"
        )


class GuidanceBackend(StructuredOutputBackend):
    """Compiles with llguidance over the engine's vocabulary (its tokenizer.json, or a synthetic vocabulary)."""

    name = "guidance"

    def __init__(self, vocab: GrammarVocab) -> None:
        super().__init__(vocab)
        self.tokenizer = _ll_tokenizer(vocab)

    def compile(self, params: StructuredOutputsParams) -> Callable[[], StructuredOutputGrammar]:
        grammar = _grammar_text(params)
        tokenizer = self.tokenizer
        eos = frozenset(t for t in self.vocab.eos_token_ids if t < self.vocab.vocab_size)
        # Compiling a matcher checks the grammar against the vocabulary; its error names what is wrong. Each
        # request's matcher is a copy of this one (a copy skips parsing the grammar again).
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {template.get_error()}")
        return lambda: GuidanceGrammar(template.deep_copy(), eos)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        grammar = _grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(
                f"structured_outputs.{params.kind} is invalid: {'; '.join(messages) or 'rejected'}"
            )


def _grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar definition (ValueError naming the field if it cannot be one)."""
    kind = params.kind
    try:
        if kind == "json":
            return _json_grammar(json.loads(json_schema_text(params)), params)
        if kind == "json_object":
            return _json_grammar({"type": "object"}, params)
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(_choice_lark(params.choice or []))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as error:
        if str(error).startswith("structured_outputs."):
            raise
        raise ValueError(f"structured_outputs.{kind} is invalid: {error}") from error
    raise ValueError(
        f"structured_outputs.{kind} is not supported by the guidance backend (use xgrammar)"
    )


def _choice_lark(choices: list[str]) -> str:
    """The choices as one lexeme (a terminal whose alternatives are the strings): the lexer matches them as one
    automaton. llguidance's own "choice" grammar makes each string a parser alternative, and its Earley parser
    refuses a row of more than 2,000 items (`max_items_in_row`), so 2,001 choices failed at the first token."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice) for choice in choices)


def _json_grammar(schema: Any, params: StructuredOutputsParams) -> str:
    """llguidance's JSON grammar, whitespace as the request asks (compact with `disable_any_whitespace`)."""
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if not params.disable_any_whitespace:
        options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"
    else:
        options["item_separator"] = ","
        options["key_separator"] = ":"
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _ll_tokenizer(vocab: GrammarVocab) -> llguidance.LLTokenizer:
    """llguidance reads the checkpoint's tokenizer.json itself. It needs a real tokenizer: it tokenizes the bytes a
    grammar forces, which a synthetic vocabulary (the hash-logits test model's) cannot do."""
    if vocab.tokenizer is None:
        raise ValueError(
            "structured_outputs: the guidance backend needs the model's tokenizer (use xgrammar)"
        )
    eos = [t for t in vocab.eos_token_ids if t < vocab.vocab_size]
    return llguidance.LLTokenizer(
        vocab.tokenizer.backend.to_str(), n_vocab=vocab.vocab_size, eos_token=eos or None
    )
