"""InputProcessor: validates and tokenizes prompts and turns them into core `Request`s (one per sample).

Shared by `LLM` and `AsyncLLM`, so both accept the same prompts and reject the same mistakes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvflow.config import ModelConfig
from kvflow.engine.request_limits import RequestLimits, short_list
from kvflow.lora.request import LoRARequest
from kvflow.model_info import load_sampling_defaults
from kvflow.pooling_params import PoolingParams
from kvflow.request import Request
from kvflow.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, wrap_int64
from kvflow.structured_output.validation import validate_structured_outputs
from kvflow.utils import child_request_id, short_repr

if TYPE_CHECKING:
    from kvflow.config import StructuredOutputsConfig
    from kvflow.model_info import ModelInfo
    from kvflow.pooling.model_spec import PoolingModelSpec
    from kvflow.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
_PROMPT_SHAPES = (
    "a string, a {'prompt_token_ids': [...]} or {'prompt': str} dict, or a list of them"
)


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    """A validated prompt: its text (None for token-id prompts), token ids, and the params to run it with."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # A pooling prompt's settings (its task set, and a text pair's `token_type_start`); None: it generates.
    pooling_params: PoolingParams | None = None


class InputProcessor:
    """Turns user prompts into core requests.

    Invariants: every token id it emits (prompt or stop token) is in [0, vocab_size); a prompt leaves room for at
    least one generated token under `max_model_len`; `logprobs` and `prompt_logprobs` are at most `max_logprobs`
    (unless that is -1) and the vocabulary size, and are refused for a model without logits (the hash model samples
    its own tokens); EOS ids beyond the model's first (generation_config.json's list) are added as stop token
    ids unless `ignore_eos`. `truncate_prompt_tokens` keeps the prompt's last k tokens before the length check;
    `bad_words` become `bad_words_token_ids` on a copy of the params (never on the caller's, which may be shared);
    `allowed_token_ids`, `logit_bias` and bad word ids are in the vocabulary; a `structured_outputs` constraint
    parses for the engine's backend. A request without SamplingParams
    runs with `default_sampling_params`: kvflow's defaults overridden by the model creator's generation_config.json
    (`ModelConfig.generation_config`). A bad prompt or parameter raises `ValueError` naming it.
    """

    def __init__(
        self,
        model_info: ModelInfo,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        model_config: ModelConfig | None = None,
        structured_outputs_config: StructuredOutputsConfig | None = None,
    ) -> None:
        """`structured_outputs_config` (the engine's) checks each request's constraint before it is queued: its
        compile limits and its backend's parse. None leaves the check to the engine core (its compile error ends
        the request with finish_reason "error")."""
        self.structured_outputs_config = structured_outputs_config
        if model_config is None:
            model_config = ModelConfig()  # its defaults: generation_config "auto", max_logprobs 20
        self.tokenizer = tokenizer
        self.runner = model_config.runner
        self.limits = RequestLimits.of(model_info, model_config, max_model_len)
        self.vocab_size = model_info.vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = model_info.eos_token_id
        if self.eos_token_id is None and tokenizer is not None:
            self.eos_token_id = tokenizer.eos_token_id
        self.extra_eos_token_ids = [
            t for t in model_info.eos_token_ids[1:] if t != self.eos_token_id
        ]
        self.default_sampling_params = _default_sampling_params(
            model_info, model_config.generation_config
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """A fresh copy of the SamplingParams used for requests that pass none."""
        return dataclasses.replace(self.default_sampling_params)

    # ------------------------------------------------------------------------------------------------ batches
    def normalize_prompts(self, prompts: object) -> list[PromptType]:
        """`LLM.generate`'s `prompts` as a list: one string or dict is a batch of one; a list, tuple or other
        iterable is a batch. A list of ints is refused (ambiguous: one token-id prompt or several prompts?), as is
        anything that is not a prompt; each ValueError says what to pass instead."""
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Iterable):
            raise ValueError(f"prompts must be {_PROMPT_SHAPES}, got {_describe(prompts)}")
        prompt_list = list(prompts)
        if prompt_list and all(_is_token_id(item) for item in prompt_list):
            raise ValueError(
                f"prompts is a list of ints ({short_list(prompt_list)}): pass token ids as "
                "{'prompt_token_ids': [...]} (a list of prompts must hold strings or dicts)"
            )
        for index, prompt in enumerate(prompt_list):
            if not isinstance(prompt, str | dict):
                hint = (
                    "; pass token ids as {'prompt_token_ids': [...]}"
                    if isinstance(prompt, list | tuple)
                    else ""
                )
                raise ValueError(
                    f"prompts[{index}] must be a string or a {{'prompt_token_ids': [...]}} dict, got "
                    f"{_describe(prompt)}{hint}"
                )
        return prompt_list

    def expand_sampling_params(
        self, sampling_params: object, num_prompts: int
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt: None means `default_sampling_params` for every prompt, one
        SamplingParams applies to all, a list gives each prompt its own (same length as the prompts)."""
        if sampling_params is None:
            return [self.default_sampling_params] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
            raise ValueError(
                "sampling_params must be SamplingParams (or a list of them, one per prompt), got "
                f"{type(sampling_params).__name__}"
            )
        for index, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise ValueError(
                    f"sampling_params[{index}] must be SamplingParams, got {type(params).__name__}"
                )
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries for {num_prompts} prompts"
            )
        return list(sampling_params)

    # ------------------------------------------------------------------------------------------------ one prompt
    def process(
        self, prompt: PromptType, sampling_params: SamplingParams | None
    ) -> ProcessedPrompt:
        """Validate and tokenize one prompt (None params: `default_sampling_params`)."""
        if self.runner != "generate":
            raise ValueError(
                f"this engine runs with runner={self.runner!r}: it embeds, classifies and scores "
                "(embed / classify / score / encode); generating text needs runner='generate'"
            )
        if sampling_params is None:
            sampling_params = self.default_sampling_params
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}"
            )
        sampling_params.validate()  # it may have been changed since it was built
        sampling_params = self.with_bad_words_token_ids(sampling_params)
        self.limits.check_params(sampling_params)
        if sampling_params.structured_outputs is not None and self.structured_outputs_config:
            validate_structured_outputs(
                sampling_params.structured_outputs, self.structured_outputs_config
            )
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = self.truncate(prompt_token_ids, sampling_params.truncate_prompt_tokens)
        if len(prompt_token_ids) >= self.max_model_len:
            truncated = (
                ""
                if sampling_params.truncate_prompt_tokens is None
                else f" after truncate_prompt_tokens={sampling_params.truncate_prompt_tokens}"
            )
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens{truncated}; max_model_len={self.max_model_len} "
                "leaves no room to generate"
            )
        return ProcessedPrompt(
            prompt_text, prompt_token_ids, self.with_model_stop_ids(sampling_params)
        )

    def process_pooling(
        self, prompt: PromptType, pooling_params: PoolingParams, spec: PoolingModelSpec
    ) -> ProcessedPrompt:
        """Validate and tokenize one pooling prompt: a string, `{"prompt_token_ids": [...]}`, or a text pair as
        `{"prompt_token_ids": [...], "token_type_ids": [0, ..., 1, ...]}` (`Tokenizer.encode_pair`). The whole
        prompt must fit `max_model_len` (pooling generates nothing), after `truncate_prompt_tokens` if given."""
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError(
                f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}"
            )
        pooling_params.validate()
        spec.check_params(pooling_params)
        token_type_ids = None
        if isinstance(prompt, dict) and "token_type_ids" in prompt:
            token_type_ids = prompt["token_type_ids"]
            prompt = {key: value for key, value in prompt.items() if key != "token_type_ids"}
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        token_type_start = _token_type_start(token_type_ids, len(prompt_token_ids))
        truncate = pooling_params.truncate_prompt_tokens
        if truncate is not None:
            keep = self.max_model_len if truncate == -1 else truncate
            removed = max(len(prompt_token_ids) - keep, 0)
            prompt_token_ids = prompt_token_ids[removed:]
            if token_type_start is not None:
                token_type_start = max(token_type_start - removed, 0)
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, more than max_model_len={self.max_model_len} "
                "(pass truncate_prompt_tokens to keep its last tokens)"
            )
        params = dataclasses.replace(pooling_params, token_type_start=token_type_start)
        return ProcessedPrompt(prompt_text, prompt_token_ids, POOLING_SAMPLING_PARAMS, params)

    def truncate(
        self, prompt_token_ids: list[int], truncate_prompt_tokens: int | None
    ) -> list[int]:
        """The last `truncate_prompt_tokens` ids; all of them for None. -1 keeps as many as the model takes while
        leaving room for one output token (`max_model_len - 1`: a prompt of `max_model_len` could not generate)."""
        if (
            truncate_prompt_tokens is None
            or truncate_prompt_tokens < -1
            or truncate_prompt_tokens == 0
        ):
            return (
                prompt_token_ids  # not a valid value: SamplingParams refuses it, naming the field
            )
        keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids

    def with_bad_words_token_ids(self, sampling_params: SamplingParams) -> SamplingParams:
        """`sampling_params`, or a copy whose `bad_words_token_ids` are its `bad_words` tokenized (None without).

        Each word is encoded without special tokens twice, as given (left-stripped) and after one space (how it
        reads inside a text), and each distinct sequence is kept once, in order. vLLM's `update_from_tokenizer`
        keeps the spaced form only when it has as many tokens as the plain one and another first token; kvflow
        keeps it whenever it differs: on the built-in model's tokenizer "fox" is 3 tokens at the start of a text
        and 2 inside one, and both must be banned.
        """
        bad_words = sampling_params.bad_words
        if not bad_words:
            if sampling_params.bad_words_token_ids is None:
                return sampling_params
            return dataclasses.replace(sampling_params, bad_words_token_ids=None)
        if self.tokenizer is None:
            raise ValueError(
                "SamplingParams.bad_words needs a tokenizer, and this engine has none (skip_tokenizer_init=True "
                "or model='hash'): drop bad_words, or ban token ids with logit_bias"
            )
        sequences: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for word in bad_words:
            stripped = word.lstrip()
            for text in (stripped, " " + stripped):
                token_ids = self.tokenizer.encode(text, add_special_tokens=False)
                if token_ids and tuple(token_ids) not in seen:
                    seen.add(tuple(token_ids))
                    sequences.append(token_ids)
        return dataclasses.replace(sampling_params, bad_words_token_ids=sequences or None)

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
        if isinstance(prompt, list | tuple) and prompt and all(map(_is_token_id, prompt)):
            raise ValueError(
                f"a prompt must be a string or a dict, got a list of ints ({short_list(prompt)}): pass token ids "
                "as {'prompt_token_ids': [...]}"
            )
        if not isinstance(prompt, dict) or not ({"prompt_token_ids", "prompt"} & prompt.keys()):
            raise ValueError(
                f"a prompt must be a string, {{'prompt_token_ids': [...]}} or {{'prompt': str}}, "
                f"got {_describe(prompt)}"
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
                    f"prompt_token_ids holds {short_repr(token_id)}, not a token id in [0, {self.vocab_size})"
                )
        return prompt.get("prompt"), list(token_ids)

    def make_requests(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        arrival_time: float,
        resumable: bool = False,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[Request]:
        """The core requests of one prompt: itself, or `n` children `i_<id>` with seeds `seed + i` (they share the
        prompt's KV blocks through the prefix cache). `priority`: lower is scheduled first (priority policy).

        Prompt logprobs are the same for every sample, so only child 0 computes them (the parent's output takes
        child 0's); the other children drop `prompt_logprobs` and so may still read the prompt from the prefix
        cache. A streaming-input session cannot ask for prompt logprobs (its prompt grows chunk by chunk).
        `lora_request` (checked by `check_lora_request`) is the adapter every request of the prompt runs with.
        """
        params = processed.sampling_params
        if processed.pooling_params is not None:
            if resumable or lora_request is not None:
                raise ValueError(
                    "a pooling request cannot be a streaming-input session or use a LoRA adapter"
                )
            return [
                Request(
                    request_id,
                    processed.prompt_token_ids,
                    params,
                    arrival_time=arrival_time,
                    priority=priority,
                    pooling_params=processed.pooling_params,
                )
            ]
        if resumable and params.prompt_logprobs is not None:
            raise ValueError(
                "SamplingParams.prompt_logprobs is not supported for a streaming-input session"
            )
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
                    lora_request=lora_request,
                )
            ]
        if resumable:
            raise ValueError("SamplingParams.n must be 1 for a streaming-input session")
        return [
            Request(
                child_request_id(request_id, index),
                processed.prompt_token_ids,
                _child_params(params, index),
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                lora_request=lora_request,
            )
            for index in range(params.n)
        ]


# What a pooling request's `Request.sampling_params` holds: it samples nothing, but the scheduler and the slots
# read a SamplingParams of every request.
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def _token_type_start(token_type_ids: object, num_tokens: int) -> int | None:
    """The first position of type 1 in a pair's `token_type_ids` (None: no 1s, or no types given); the types must
    be one per token, 0s then 1s (the two texts of a pair), else a ValueError naming `token_type_ids`."""
    if token_type_ids is None:
        return None
    if not isinstance(token_type_ids, list | tuple) or len(token_type_ids) != num_tokens:
        raise ValueError(
            f"token_type_ids must be a list of {num_tokens} ints (one per prompt token)"
        )
    if any(value not in (0, 1) or isinstance(value, bool) for value in token_type_ids):
        raise ValueError("token_type_ids must hold 0s and 1s")
    start = next((i for i, value in enumerate(token_type_ids) if value == 1), None)
    if start is not None and any(value != 1 for value in token_type_ids[start:]):
        raise ValueError("token_type_ids must be 0s then 1s (the first text, then the second)")
    return start


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an `n` > 1 request: n=1, its own seed (`seed + index`, wrapped into int64 as the
    sampler's 64-bit seed mixing would), prompt logprobs on child 0 only."""
    return dataclasses.replace(
        params,
        n=1,
        seed=None if params.seed is None else wrap_int64(params.seed + index),
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


def _default_sampling_params(model_info: ModelInfo, generation_config: str) -> SamplingParams:
    """kvflow's SamplingParams with the model's generation_config.json defaults applied (logged once at INFO)."""
    defaults = load_sampling_defaults(model_info.path, generation_config)
    if defaults:
        logger.info(
            "Default sampling parameters have been overridden by the model's generation config "
            "(generation_config.json, as recommended by the model creator): %s. Requests without "
            "SamplingParams use them; pass generation_config='kvflow' to use kvflow's defaults instead.",
            ", ".join(f"{name}={value!r}" for name, value in defaults.items()),
        )
    return SamplingParams(**defaults)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: object) -> str:
    """A short description of a wrong value for an error message: its type and a bounded repr."""
    return f"{type(value).__name__} {short_repr(value)}"


def check_lora_request(lora_request: object, lora_enabled: bool) -> LoRARequest | None:
    """A request's adapter: None, or a `LoRARequest` on an engine with LoRA enabled (a ValueError naming
    `lora_request` otherwise)."""
    if lora_request is None:
        return None
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(
            f"lora_request must be a LoRARequest or None, got {_describe(lora_request)}"
        )
    if not lora_enabled:
        raise ValueError(
            f"lora_request {lora_request.lora_name!r}: LoRA is not enabled (enable_lora=True, --enable-lora)"
        )
    return lora_request


def expand_lora_requests(
    lora_request: object, num_prompts: int, lora_enabled: bool
) -> list[LoRARequest | None]:
    """One adapter per prompt from `generate`'s `lora_request`: None, one `LoRARequest` for every prompt, or a
    list with one entry (a LoRARequest or None) per prompt."""
    if isinstance(lora_request, list | tuple):
        if len(lora_request) != num_prompts:
            raise ValueError(
                f"lora_request has {len(lora_request)} entries for {num_prompts} prompts"
            )
        return [check_lora_request(item, lora_enabled) for item in lora_request]
    return [check_lora_request(lora_request, lora_enabled)] * num_prompts


def check_priority(priority: object, scheduling_policy: str) -> int:
    """A request's priority (lower runs first): an int64, and non-zero only under the "priority" policy."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {short_repr(priority)}")
    if not INT64_MIN <= priority <= INT64_MAX:
        raise ValueError(f"priority must be an int in [-2**63, 2**63), got {short_repr(priority)}")
    if priority and scheduling_policy != "priority":
        raise ValueError(
            f"priority={priority} needs scheduling_policy='priority' (this engine schedules "
            f"{scheduling_policy!r})"
        )
    return priority
