"""kvflow's per-position logprobs (`{token_id: Logprob}`, the actual token first) in OpenAI's two shapes.

/v1/completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (`{token text: logprob}`: the actual token
and the `logprobs` most likely ones, so up to `logprobs + 1` entries) and `text_offset`. A position without a
distribution (the first prompt token under `echo`) has `None` in `token_logprobs` and `top_logprobs`.
/v1/chat/completions: `content`, one `{token, logprob, bytes, top_logprobs}` per generated token, `top_logprobs`
being the `top_logprobs` most likely tokens by rank.

Logprobs are clamped at -9999.0 (JSON has no -inf), as vLLM does; an entry for the actual token in `top_logprobs`
always carries the same float as `token_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvflow.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprobs,
)
from kvflow.entrypoints.openai.protocol import Logprob as LogprobBody

if TYPE_CHECKING:
    from kvflow.outputs import CompletionOutput, Logprob
    from kvflow.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0

Positions = Sequence["dict[int, Logprob] | None"]


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenTexts:
    """The text shown for a token id: `token_id:N` when asked for (vLLM's `return_tokens_as_token_ids`) or when
    there is no tokenizer (the hash model), else the Logprob's decoded text, else the tokenizer's decode."""

    def __init__(self, tokenizer: Tokenizer | None, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids or tokenizer is None

    def text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if self.as_token_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Positions,
    num_top: int,
    texts: TokenTexts,
    initial_text_offset: int = 0,
) -> CompletionLogProbs:
    """The completions `logprobs` object of `token_ids` (`positions[i]` is token i's distribution or None);
    offsets start at `initial_text_offset` (the text already streamed for this choice)."""
    tokens: list[str] = []
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offset = initial_text_offset
    for token_id, position in zip(token_ids, positions, strict=True):
        actual = position.get(token_id) if position is not None else None
        token = texts.text(token_id, actual)
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if position is None or actual is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp(actual.logprob))
        top = {token: clamp(actual.logprob)}  # first, and never overwritten by a same-text token
        for other_id, other in position.items():
            if other_id != token_id and other.rank is not None and other.rank <= num_top:
                top.setdefault(texts.text(other_id, other), clamp(other.logprob))
        top_logprobs.append(top)
    # Passed to the constructor, not appended to its defaults: a streamed chunk leaves out unset fields.
    return CompletionLogProbs(
        text_offset=text_offset,
        token_logprobs=token_logprobs,
        tokens=tokens,
        top_logprobs=top_logprobs,
    )


def chat_logprobs(
    token_ids: Sequence[int], positions: Positions, num_top: int, texts: TokenTexts
) -> ChatCompletionLogProbs:
    """The chat `logprobs` object of generated `token_ids` with their distributions."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        position = position or {}
        actual = position.get(token_id)
        token = texts.text(token_id, actual)
        ranked = sorted(
            (
                (logprob.rank, other_id, logprob)
                for other_id, logprob in position.items()
                if logprob.rank is not None and logprob.rank <= num_top
            ),
            key=lambda entry: entry[0],
        )
        content.append(
            ChatCompletionLogProbsContent(
                token=token,
                logprob=clamp(actual.logprob) if actual is not None else MIN_LOGPROB,
                bytes=_utf8(token),
                top_logprobs=[
                    ChatCompletionLogProb(
                        token=(text := texts.text(other_id, logprob)),
                        logprob=clamp(logprob.logprob),
                        bytes=_utf8(text),
                    )
                    for _, other_id, logprob in ranked
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs_body(prompt_logprobs: Positions | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` field: per prompt position None or `{token_id: {logprob, rank, decoded_token}}`."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            token_id: LogprobBody(
                logprob=clamp(logprob.logprob),
                rank=logprob.rank,
                decoded_token=logprob.decoded_token,
            )
            for token_id, logprob in position.items()
        }
        for position in prompt_logprobs
    ]


def output_positions(output: CompletionOutput) -> list[dict[int, Logprob] | None]:
    """One distribution (None where the engine gave none, e.g. the hash model) per token of `output`."""
    positions: list[dict[int, Logprob] | None] = list(output.logprobs or [])
    return positions + [None] * (len(output.token_ids) - len(positions))


def prompt_positions(
    prompt_token_ids: Sequence[int], prompt_logprobs: Positions | None
) -> list[dict[int, Logprob] | None]:
    """One distribution per prompt token: None for the first, and for all when none were computed."""
    positions = list(prompt_logprobs or [])[: len(prompt_token_ids)]
    return positions + [None] * (len(prompt_token_ids) - len(positions))


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
