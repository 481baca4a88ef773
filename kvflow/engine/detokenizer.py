"""Incremental detokenization and stop strings.

Text is decoded over a small sliding window of token ids (vLLM's prefix_offset/read_offset scheme): each new token
costs one decode of the window, whose length does not grow with the output. Text is emitted only when it can no
longer change: a trailing U+FFFD may be a multi-byte UTF-8 character whose remaining bytes are in the next token,
so it is held until a later token completes it (or until the request finishes). For byte-level BPE tokenizers the
concatenated text therefore equals `tokenizer.decode(output_token_ids)` exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.sampling_params import SamplingParams
    from kvflow.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so that decoders which treat the first token specially (e.g.
# SentencePiece's leading-space strip) see the output as a continuation. Byte-level decoding needs none.
NUM_PROMPT_CONTEXT_TOKENS = 5


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text on its own (logprob `decoded_token`): special tokens shown, partial UTF-8 as U+FFFD."""
    return tokenizer.backend.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """One request's output text, decoded as tokens arrive, with stop-string detection.

    Every operation costs O(its new text), whatever the length of the output: the text is kept as a list of pieces
    (never one string grown by copying), stop strings are searched in the new text plus the few characters before
    it where a match could begin (`_recent`), and a delta is read from the pieces after a cursor. Only a cumulative
    output (the whole text, by definition) costs the text's length.

    Invariants:
      * the text (`"".join(_pieces)`, `_length` characters) only ever grows (until a stop string truncates it once)
        and never ends inside a character that a later token may still complete; `_window_ids[:_read_index]`
        decodes to `_prefix_text`, and the window's text beyond it is in the text up to `_window_emitted`
        characters.
      * `_recent` is the text's last `_match_context` characters (fewer while the text is shorter).
      * `_delta_end` characters have been returned as deltas; they start in `_pieces[_cursor_piece]` at offset
        `_cursor_offset` (`_cursor_piece == len(_pieces)` once all were).
      * A stop string is searched only in text that arrived in this update (plus the `len(stop) - 1` characters
        before it, where a match could begin); among matches, the one that completes first wins (ties: the
        longer one), so the result does not depend on how tokens are grouped into updates.
      * While unfinished, `get_next_output_text` holds back the last `max(len(stop)) - 1` characters (when stop
        strings exist and are excluded from the output), so a partial stop string never reaches the user.
      * Once finished, everything is released: the text then equals the full decode of the output tokens, cut
        at the stop string if one matched, and without a stop token's text when the engine stopped on one and
        `include_stop_str_in_output` is False (vLLM's behaviour).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend
        self.skip_special_tokens = sampling_params.skip_special_tokens
        self.stop: list[str] = list(sampling_params.stop or [])
        self.include_stop_str_in_output = sampling_params.include_stop_str_in_output
        self.min_tokens = sampling_params.min_tokens
        self._match_context = max(map(len, self.stop)) - 1 if self.stop else 0
        self.stop_buffer_length = 0 if self.include_stop_str_in_output else self._match_context
        self.num_output_tokens = 0
        self.stop_string: str | None = None  # the stop string that matched, once one has
        self._pieces: list[str] = []
        self._length = 0
        self._recent = ""
        self._delta_end = 0
        self._cursor_piece = 0
        self._cursor_offset = 0
        self._finished = False
        self._window_ids, self._prefix_text = self._initial_context(prompt_token_ids)
        self._read_index = len(self._window_ids)
        self._window_emitted = 0

    @property
    def output_text(self) -> str:
        """All text decoded so far (complete characters only until the request finishes; no stop hold-back)."""
        return "".join(self._pieces)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append a step's tokens; returns the stop string that ended the request, if one matched now.

        `stop_terminated` says the engine stopped on the last token (EOS or a stop token id): that token's text is
        then left out unless `include_stop_str_in_output`.
        """
        if not new_token_ids or self.stop_string is not None:
            self.num_output_tokens += len(new_token_ids)
            return None
        skip_last = stop_terminated and not self.include_stop_str_in_output
        length_before = self._length
        stop_check_offset = length_before  # no stop string may end within the first min_tokens
        new_pieces = []
        for token_id in new_token_ids[:-1] if skip_last else new_token_ids:
            self.num_output_tokens += 1
            piece = self._decode_next(token_id)
            if piece:
                new_pieces.append(piece)
                self._length += len(piece)
            if self.num_output_tokens <= self.min_tokens:
                stop_check_offset = self._length
        if skip_last:
            self.num_output_tokens += 1
        if not new_pieces:
            return None
        self._pieces.extend(new_pieces)
        if not self.stop:
            return None
        # The new text and the characters before it where a match could begin (at least up to the check offset).
        window = self._recent + "".join(new_pieces)
        self._recent = window[-self._match_context :] if self._match_context else ""
        if self._length == stop_check_offset:
            return None
        return self._check_stop_strings(
            window, self._length - len(window), self._length - stop_check_offset
        )

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show: cumulative, or (`delta`) only what is new since the last delta call.

        While unfinished the stop-string buffer is held back; `finished=True` releases everything, including a
        trailing incomplete character (as U+FFFD, like a full decode).
        """
        if finished:
            self._finish()
        held_back = 0 if (finished or self.stop_string is not None) else self.stop_buffer_length
        end = max(self._length - held_back, 0)
        if not delta:
            return "".join(self._pieces)[:end]
        if self._delta_end >= end:
            return ""
        return self._take_delta(end)

    def _take_delta(self, end: int) -> str:
        """The text from `_delta_end` to `end`, read from the pieces after the cursor, which moves to `end`."""
        parts = []
        needed = end - self._delta_end
        pieces, index, offset = self._pieces, self._cursor_piece, self._cursor_offset
        while needed:
            piece = pieces[index]
            taken = piece[offset : offset + needed]
            parts.append(taken)
            needed -= len(taken)
            offset += len(taken)
            if offset == len(piece):
                index, offset = index + 1, 0
        self._cursor_piece, self._cursor_offset, self._delta_end = index, offset, end
        return parts[0] if len(parts) == 1 else "".join(parts)

    # ------------------------------------------------------------------------------------------------ decoding
    def _initial_context(self, prompt_token_ids: list[int]) -> tuple[list[int], str]:
        context = [int(token_id) for token_id in prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            return [], ""  # the prompt ends inside a character: the output must not claim its bytes
        return context, context_text

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        """Add one token to the window; return the text that became final."""
        self._window_ids.append(token_id)
        window_text = self._decode(self._window_ids)
        emitted_end = len(self._prefix_text) + self._window_emitted
        if len(window_text) > len(self._prefix_text) and not window_text.endswith(REPLACEMENT_CHAR):
            # Everything up to here is final: slide the window so it starts at the previous read point.
            self._window_ids = self._window_ids[self._read_index :]
            self._read_index = len(self._window_ids)
            self._prefix_text = self._decode(self._window_ids)
            self._window_emitted = 0
            return window_text[emitted_end:]
        # Emit what precedes the trailing replacement characters; the rest may still change.
        stable_end = len(window_text.rstrip(REPLACEMENT_CHAR))
        if stable_end <= emitted_end:
            return ""
        self._window_emitted = stable_end - len(self._prefix_text)
        return window_text[emitted_end:stable_end]

    def _finish(self) -> None:
        """Release the text still held in the window (replacement characters for bytes no token completed)."""
        if self._finished:
            return
        self._finished = True
        if self.stop_string is not None:
            return
        window_text = self._decode(self._window_ids)
        rest = window_text[len(self._prefix_text) + self._window_emitted :]
        if rest:
            self._pieces.append(rest)
            self._length += len(rest)

    # ------------------------------------------------------------------------------------------------ stop strings
    def _check_stop_strings(
        self, window: str, window_start: int, new_char_count: int
    ) -> str | None:
        """Search `window` (the text from character `window_start` on) for a stop string completing in its last
        `new_char_count` characters; on a match, cut the text there (keeping the stop string if asked)."""
        match = find_stop_string(window, new_char_count, self.stop)
        if match is None:
            return None
        stop_string, start = match
        cut = window_start + start + (len(stop_string) if self.include_stop_str_in_output else 0)
        self._truncate(cut)
        self.stop_string = stop_string
        return stop_string

    def _truncate(self, length: int) -> None:
        """Cut the text to its first `length` characters (never before what deltas returned: a partial stop
        string is held back, so a match starts after it)."""
        pieces = self._pieces
        while self._length > length:
            last = pieces.pop()
            if self._length - len(last) < length:
                pieces.append(last[: length - (self._length - len(last))])
                self._length = length
            else:
                self._length -= len(last)


def find_stop_string(text: str, new_char_count: int, stop: list[str]) -> tuple[str, int] | None:
    """The stop string that completes first within the last `new_char_count` characters of `text`, and where it
    starts; ties go to the longer string. Only matches ending in the new characters are considered."""
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    num_old_chars = len(text) - new_char_count
    for stop_string in stop:
        start = text.find(stop_string, max(num_old_chars - len(stop_string) + 1, 0))
        if start == -1:
            continue
        candidate = (start + len(stop_string), start, stop_string)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return (best[2], best[1]) if best is not None else None
