"""InputProcessor: validates and tokenizes prompts and turns them into core `Request`s (one per sample).

Shared by `LLM` and `AsyncLLM`, so both accept the same prompts and reject the same mistakes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.utils import child_request_id

if TYPE_CHECKING:
    from kvflow.model_info import ModelInfo
    from kvflow.tokenizer import Tokenizer

PromptType = str | dict[str, Any]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    """A validated prompt: its text (None for token-id prompts), token ids, and the params to run it with."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class InputProcessor:
    """Turns user prompts into core requests.

    Invariants: every token id it emits is in [0, vocab_size); a prompt leaves room for at least one generated
    token under `max_model_len`; EOS ids beyond the model's first (generation_config.json's list) are added as stop
    token ids unless `ignore_eos`. A bad prompt or parameter raises `ValueError` naming it.
    """

    def __init__(
        self, model_info: ModelInfo, tokenizer: Tokenizer | None, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = model_info.vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = model_info.eos_token_id
        if self.eos_token_id is None and tokenizer is not None:
            self.eos_token_id = tokenizer.eos_token_id
        self.extra_eos_token_ids = [
            t for t in model_info.eos_token_ids[1:] if t != self.eos_token_id
        ]

    def process(
        self, prompt: PromptType, sampling_params: SamplingParams | None
    ) -> ProcessedPrompt:
        """Validate and tokenize one prompt."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}"
            )
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len={self.max_model_len} leaves "
                "no room to generate"
            )
        return ProcessedPrompt(
            prompt_text, prompt_token_ids, self.with_model_stop_ids(sampling_params)
        )

    def with_model_stop_ids(self, sampling_params: SamplingParams) -> SamplingParams:
        if not self.extra_eos_token_ids or sampling_params.ignore_eos:
            return sampling_params
        stop_token_ids = list(sampling_params.stop_token_ids or [])
        stop_token_ids += [t for t in self.extra_eos_token_ids if t not in stop_token_ids]
        return dataclasses.replace(sampling_params, stop_token_ids=stop_token_ids)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a string, `{"prompt_token_ids": [...]}` or `{"prompt": "..."}` prompt."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this engine has no tokenizer (skip_tokenizer_init=True or model='hash'): "
                    "pass {'prompt_token_ids': [...]} prompts"
                )
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise ValueError("prompt is empty after tokenization")
            return prompt, token_ids
        if not isinstance(prompt, dict) or not ({"prompt_token_ids", "prompt"} & prompt.keys()):
            raise ValueError(
                f"a prompt must be a string, {{'prompt_token_ids': [...]}} or {{'prompt': str}}, "
                f"got {prompt!r}"
            )
        unknown_keys = sorted(prompt.keys() - _PROMPT_KEYS)
        if unknown_keys:
            raise ValueError(
                f"a prompt dict takes only {sorted(_PROMPT_KEYS)}; unknown key(s) {unknown_keys} (pass priority "
                "to generate(), sampling settings in SamplingParams)"
            )
        if "prompt_token_ids" not in prompt:
            return self.tokenize(prompt["prompt"])
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, list | tuple) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        for token_id in token_ids:
            if (
                not isinstance(token_id, int)
                or isinstance(token_id, bool)
                or not 0 <= token_id < self.vocab_size
            ):
                raise ValueError(
                    f"prompt_token_ids holds {token_id!r}, not a token id in [0, {self.vocab_size})"
                )
        return prompt.get("prompt"), list(token_ids)

    def make_requests(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        arrival_time: float,
        resumable: bool = False,
        priority: int = 0,
    ) -> list[Request]:
        """The core requests of one prompt: itself, or `n` children `i_<id>` with seeds `seed + i` (they share the
        prompt's KV blocks through the prefix cache). `priority`: lower is scheduled first (priority policy)."""
        params = processed.sampling_params
        if params.n == 1:
            return [
                Request(
                    request_id,
                    processed.prompt_token_ids,
                    params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival_time,
                    priority=priority,
                    resumable=resumable,
                )
            ]
        if resumable:
            raise ValueError("SamplingParams.n must be 1 for a streaming-input session")
        return [
            Request(
                child_request_id(request_id, index),
                processed.prompt_token_ids,
                dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + index
                ),
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
            )
            for index in range(params.n)
        ]


def check_priority(priority: object, scheduling_policy: str) -> int:
    """A request's priority (lower runs first): an int, and non-zero only under the "priority" policy."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if priority and scheduling_policy != "priority":
        raise ValueError(
            f"priority={priority} needs scheduling_policy='priority' (this engine schedules "
            f"{scheduling_policy!r})"
        )
    return priority
