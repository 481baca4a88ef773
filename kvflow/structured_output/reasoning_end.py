"""vLLM's rule for structured outputs under a reasoning parser: a request's constraint starts where its reasoning
ends, so it shapes the answer (the server's `message.content`) and not the thought.

The engine core agrees with the parser (`kvflow.reasoning.base`) on where that is:

  * The output starts in reasoning iff `parser.starts_in_reasoning(prompt text)`, the prompt text being the
    request's prompt tokens decoded with special tokens shown (for a chat request: the rendered chat template, the
    text the server hands the parser). Otherwise the constraint applies from the first token. So an output that
    does not start in reasoning can open a `<think>` only if the constraint itself allows that text; if it does, the
    parser reads it as reasoning while the engine constrained it, and `content` is a suffix of the constrained
    text rather than all of it (a constraint that cannot start with `<think>`, i.e. any JSON, choice or regex
    that does not spell it, never meets this).
  * In reasoning, the reasoning ends with the token that completes the parser's end marker (`</think>`), found on
    the output's decoded bytes (the parser's first end marker, since nothing before it can contain one); the
    constraint starts with the next token. A token that completes the marker and also carries text after it
    (`"k>\\n\\nYes"`) has that text unconstrained: the parser's content is that text, minus leading newlines,
    followed by the constrained text. With Qwen3 and DeepSeek-R1 the marker is one token or ends a token, and the
    newlines after it are trimmed, so content is exactly the constrained text.

The engine core has no detokenizer: markers are found in each token's bytes (`TokenTexts`), which is needed because
a byte-level BPE vocabulary without a `</think>` token (the built-in model's) spells it over several tokens. Output
special tokens count as text only if the request keeps them (`skip_special_tokens=False`), as in its detokenized
text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.reasoning import ReasoningParser
    from kvflow.structured_output.backend import GrammarVocab
    from kvflow.tokenizer import Tokenizer

# SentencePiece's word marker and byte-fallback tokens (`<0x0A>`), for vocabularies that are not byte-level.
_WORD_MARKER = "\u2581"
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenTexts:
    """Each token id's text as bytes (`token_bytes[id]`; b"" past the tokenizer's vocabulary), as the tokenizer's
    decoder writes it when tokens are decoded together, and the ids a detokenizer skips with
    `skip_special_tokens` (added tokens marked special)."""

    token_bytes: Sequence[bytes]
    special_token_ids: frozenset[int] = frozenset()

    @classmethod
    def of_vocab(cls, vocab: GrammarVocab) -> TokenTexts:
        if vocab.token_bytes is not None:
            return cls(vocab.token_bytes)
        assert vocab.tokenizer is not None, "a GrammarVocab needs a tokenizer or token_bytes"
        return _tokenizer_texts(vocab.tokenizer, vocab.vocab_size)

    def token_text(self, token_id: int, skip_special_tokens: bool) -> bytes:
        if skip_special_tokens and token_id in self.special_token_ids:
            return b""
        return self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens shown (a prompt as it was rendered)."""
        token_bytes = self.token_bytes
        num_tokens = len(token_bytes)
        raw = b"".join(token_bytes[t] for t in token_ids if 0 <= t < num_tokens)
        return raw.decode("utf-8", errors="replace")


@dataclass
class ReasoningEndDetector:
    """Watches one request's kept output tokens, in order, for the end marker.

    Invariant: `tail` is the last `len(end_marker) - 1` bytes (or fewer) of the output so far, so a marker that
    `accept` completes lies in `tail` + the new token's bytes, and memory stays constant however long the
    reasoning runs.
    """

    end_marker: bytes
    token_texts: TokenTexts
    skip_special_tokens: bool = True
    tail: bytes = b""

    def accept(self, token_id: int) -> bool:
        """Take the next kept output token; True if it completed the end marker (the reasoning ended with it)."""
        window = self.tail + self.token_texts.token_text(token_id, self.skip_special_tokens)
        if self.end_marker in window:
            return True
        self.tail = window[max(0, len(window) - len(self.end_marker) + 1) :]
        return False


@dataclass(frozen=True)
class ReasoningGate:
    """One engine's reasoning parser over its vocabulary: where each request's reasoning starts (see the module
    docstring). Shared by every request; the state of one output is its `ReasoningEndDetector`."""

    parser: ReasoningParser
    token_texts: TokenTexts

    def detector_for(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> ReasoningEndDetector | None:
        """A detector if an output after `prompt_token_ids` starts in reasoning; None if it starts constrained."""
        if not self.parser.starts_in_reasoning(self.token_texts.decode(prompt_token_ids)):
            return None
        return ReasoningEndDetector(
            self.parser.end_marker.encode(), self.token_texts, skip_special_tokens
        )


def _tokenizer_texts(tokenizer: Tokenizer, vocab_size: int) -> TokenTexts:
    """Token bytes from the vocabulary's token strings: byte-level BPE maps each character back to its byte
    (GPT-2's table); SentencePiece-style vocabularies turn the word marker into a space and `<0xNN>` tokens into
    their byte. Added tokens are their content."""
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    decoder = backend.decoder.__getstate__().decode() if backend.decoder is not None else ""
    byte_level = '"ByteLevel"' in decoder
    byte_fallback = '"ByteFallback"' in decoder
    char_to_byte = _byte_level_chars()
    token_bytes: list[bytes] = []
    for token_id in range(vocab_size):
        if token_id in added:
            token_bytes.append(added[token_id].content.encode())
            continue
        piece = backend.id_to_token(token_id)
        if piece is None:
            token_bytes.append(b"")
        elif byte_level and all(char in char_to_byte for char in piece):
            token_bytes.append(bytes(char_to_byte[char] for char in piece))
        elif byte_fallback and (match := _BYTE_FALLBACK_TOKEN.fullmatch(piece)):
            token_bytes.append(bytes([int(match.group(1), 16)]))
        else:
            token_bytes.append(piece.replace(_WORD_MARKER, " ").encode())
    special = frozenset(token_id for token_id, token in added.items() if token.special)
    return TokenTexts(token_bytes, special)


@cache
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), reversed: character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    char_to_byte = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            char_to_byte[chr(256 + shifted)] = byte
            shifted += 1
    return char_to_byte
