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

    Invariants:
      * `output_text` only ever grows (until a stop string truncates it once) and never ends inside a character
        that a later token may still complete; `_window_ids[:_read_index]` decodes to `_prefix_text`, and the
        window's text beyond it is in `output_text` up to `_window_emitted` characters.
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
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.num_output_tokens = 0
        self.stop_string: str | None = None  # the stop string that matched, once one has
        self._text = ""
        self._last_output_text_offset = 0
        self._finished = False
        self._window_ids, self._prefix_text = self._initial_context(prompt_token_ids)
        self._read_index = len(self._window_ids)
        self._window_emitted = 0

    @property
    def output_text(self) -> str:
        """All text decoded so far (complete characters only until the request finishes; no stop hold-back)."""
        return self._text

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append a step's tokens; returns the stop string that ended the request, if one matched now.

        `stop_terminated` says the engine stopped on the last token (EOS or a stop token id): that token's text is
        then left out unless `include_stop_str_in_output`.
        """
        if not new_token_ids or self.stop_string is not None:
            self.num_output_tokens += len(new_token_ids)
            return None
        skip_last = stop_terminated and not self.include_stop_str_in_output
        stop_check_offset = len(self._text)
        for token_id in new_token_ids[:-1] if skip_last else new_token_ids:
            self.num_output_tokens += 1
            self._text += self._decode_next(token_id)
            if self.num_output_tokens <= self.min_tokens:
                stop_check_offset = len(
                    self._text
                )  # no stop string may end within the first min_tokens
        if skip_last:
            self.num_output_tokens += 1
        if not self.stop or len(self._text) == stop_check_offset:
            return None
        return self._check_stop_strings(len(self._text) - stop_check_offset)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show: cumulative, or (`delta`) only what is new since the last delta call.

        While unfinished the stop-string buffer is held back; `finished=True` releases everything, including a
        trailing incomplete character (as U+FFFD, like a full decode).
        """
        if finished:
            self._finish()
        held_back = 0 if (finished or self.stop_string is not None) else self.stop_buffer_length
        end = max(len(self._text) - held_back, 0)
        if not delta:
            return self._text[:end]
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self._text[start:end]

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
        self._text += window_text[len(self._prefix_text) + self._window_emitted :]

    # ------------------------------------------------------------------------------------------------ stop strings
    def _check_stop_strings(self, new_char_count: int) -> str | None:
        match = find_stop_string(self._text, new_char_count, self.stop)
        if match is None:
            return None
        stop_string, start = match
        self._text = (
            self._text[: start + len(stop_string)]
            if self.include_stop_str_in_output
            else self._text[:start]
        )
        self.stop_string = stop_string
        return stop_string


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
