"""What the completion and chat handlers share: request ids, prompt checks, sampling params and running requests.

A request is checked completely before anything reaches the engine (model name, fields kvflow does not implement yet,
its structured-output constraint and logits controls, prompt length against `max_model_len`, every sampling field,
the prompt's token ids), so a bad request is a 400 naming its field and never a half-started stream. Requests then
run through `AsyncLLM.generate`, one engine request per prompt; a client that goes away (a closed stream, or a
disconnect while waiting for a whole response) cancels the consumer, which aborts the engine requests and frees
their KV blocks and slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from kvflow.config import STRUCTURED_OUTPUT_BACKENDS
from kvflow.engine.input_processor import check_priority
from kvflow.entrypoints.openai.errors import OpenAIServingError, bad_request
from kvflow.entrypoints.openai.logprobs import TokenTexts
from kvflow.entrypoints.openai.middleware import REQUEST_ID_HEADER
from kvflow.entrypoints.openai.protocol import UsageInfo
from kvflow.entrypoints.openai.server_config import ServingLimits
from kvflow.entrypoints.openai.unsupported import UnknownFields, refuse_unsupported_fields
from kvflow.model_info import load_sampling_defaults
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.structured_output.validation import validate_structured_outputs
from kvflow.tracing import current_trace_headers
from kvflow.utils import short_repr

if TYPE_CHECKING:
    from fastapi import Request

    from kvflow.config import StructuredOutputsConfig
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.engine.input_processor import ProcessedPrompt
    from kvflow.engine.request_limits import RequestLimits
    from kvflow.entrypoints.openai.protocol import ResponseFormat, SamplingFields
    from kvflow.entrypoints.openai.serving_models import OpenAIServingModels
    from kvflow.lora.request import LoRARequest
    from kvflow.outputs import RequestOutput
    from kvflow.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# Texts at least this long are tokenized off the event loop; requests with more prompts than this are prepared there.
LONG_TEXT_CHARS = 16384
MANY_PROMPTS = 16
# The status of a response whose client went away (it is never sent; nginx logs such requests as 499).
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class RequestControls:
    """What one request asks of the logits, checked once for all its prompts and in SamplingParams' terms: its
    structured-output constraint and its logits controls.

    Invariants: `structured_outputs` is the request's one constraint, and it parses for the server's backend;
    every token id in `allowed_token_ids` and `logit_bias` is in the vocabulary, every bias in [-100, 100]; none
    of them is set for a model without logits (the hash model).
    """

    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None

    def options(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments of the fields that are set."""
        return {
            spec.name: getattr(self, spec.name)
            for spec in dataclasses.fields(self)
            if getattr(self, spec.name) is not None
        }


@dataclass(frozen=True)
class PromptInput:
    """One prompt, checked and tokenized: its text (None for token ids without a tokenizer), ids and params."""

    text: str | None
    token_ids: list[int]
    sampling_params: SamplingParams


class LiveRequests:
    """The requests this server is running, by the id the client knows (its X-Request-Id, or a generated one).

    Invariants: an id is live from the moment its engine requests start until its response is done; two live
    requests never share an id; `engine_ids[id]` are the engine request ids behind it (one per prompt). Used from
    the event loop only.
    """

    def __init__(self) -> None:
        self.engine_ids: dict[str, list[str]] = {}

    def check_free(self, request_id: str, param: str | None = None) -> None:
        if request_id in self.engine_ids:
            raise OpenAIServingError(
                f"request id {request_id!r} is already in use by a running request", param=param
            )

    @contextlib.contextmanager
    def claim(self, request_id: str, engine_ids: list[str]) -> Iterator[None]:
        self.check_free(request_id)
        self.engine_ids[request_id] = engine_ids
        try:
            yield
        finally:
            del self.engine_ids[request_id]

    def resolve(self, request_ids: Sequence[str] | None) -> dict[str, list[str]]:
        """The live ones among `request_ids` (each as given, or as a response `id`, `cmpl-<id>` / `chatcmpl-<id>` /
        `embd-<id>` ...: `RESPONSE_ID_PREFIXES`), with their engine ids; None means every live request."""
        if request_ids is None:
            return dict(self.engine_ids)
        found: dict[str, list[str]] = {}
        for request_id in request_ids:
            for candidate in (request_id, *_without_response_prefix(request_id)):
                if candidate in self.engine_ids:
                    found[request_id] = self.engine_ids[candidate]
                    break
        return found


# The prefixes of response ids (`<prefix><request id>`): completions, chat, responses, and the pooling endpoints'.
RESPONSE_ID_PREFIXES = (
    "cmpl-",
    "chatcmpl-",
    "resp_",
    "embd-",
    "pool-",
    "classify-",
    "score-",
    "rerank-",
)


def _without_response_prefix(response_id: str) -> list[str]:
    return [
        response_id[len(prefix) :]
        for prefix in RESPONSE_ID_PREFIXES
        if response_id.startswith(prefix)
    ]


class OpenAIServing:
    """The part of /v1/completions and /v1/chat/completions that does not depend on the endpoint.

    Invariants: every `SamplingParams` it builds takes the model's defaults (`AsyncLLM.get_default_sampling_params`,
    i.e. generation_config.json) for the fields a request leaves unset, as vLLM does; `max_tokens` never exceeds
    what `max_model_len` leaves after the prompt.
    """

    # The engine's names for a request's fields, where they differ (see `errors.param_of`).
    aliases: Mapping[str, str] = {"prompt_token_ids": "prompt"}

    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        live_requests: LiveRequests,
        limits: ServingLimits | None = None,
        unknown_fields: UnknownFields | None = None,
    ) -> None:
        """`unknown_fields`: where the names of ignored request fields are logged, once each (one per app)."""
        self.engine = engine
        self.models = models
        self.live_requests = live_requests
        self.limits = limits if limits is not None else ServingLimits()
        self.unknown_fields = unknown_fields if unknown_fields is not None else UnknownFields()
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = models.max_model_len
        self.default_sampling_params = engine.get_default_sampling_params()
        model_config = engine.engine_config.model_config
        # generation_config.json's max_new_tokens, if any: a cap on every request, as in vLLM.
        self.default_max_tokens: int | None = load_sampling_defaults(
            engine.model_info.path, model_config.generation_config
        ).get("max_tokens")
        self.scheduling_policy = engine.engine_config.scheduler_config.policy
        self.structured_outputs_config = engine.engine_config.structured_outputs_config
        self.structured_outputs_backend = self.structured_outputs_config.backend

    # ------------------------------------------------------------------------------------------------ checks
    def check_request(self, request: SamplingFields) -> LoRARequest | None:
        """What every generation request must pass before its prompt is looked at; returns the LoRA adapter its
        `model` names (None: the base model; an unknown name is a 404)."""
        self.check_engine_alive()
        lora_request = self.models.resolve(request.model)
        self.unknown_fields.report(request.model_extra)
        self.check_limits(request)
        refuse_unsupported_fields(request)
        if request.stream_options is not None and not request.stream:
            raise OpenAIServingError(
                "stream_options can only be set when stream is true", param="stream_options"
            )
        try:
            check_priority(request.priority, self.scheduling_policy)
        except ValueError as error:
            raise OpenAIServingError(str(error), param="priority") from error
        return lora_request

    def check_limits(self, request: SamplingFields) -> None:
        """The bounds every generation request shares (`ServingLimits`: n, best_of, stop, logit_bias)."""
        limits = self.limits
        _check_count("n", request.n, limits.max_n, "--max-n")
        best_of = getattr(request, "best_of", None)
        if best_of is not None:
            _check_count("best_of", best_of, limits.max_n, "--max-n")
        stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
        _check_count("stop", len(stop), limits.max_stop_strings, "--max-stop-strings", "strings")
        longest = max(map(len, stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise OpenAIServingError(
                f"stop holds a string of {longest} characters; this server takes at most "
                f"{limits.max_stop_string_chars} (--max-stop-string-chars)",
                param="stop",
            )
        if request.logit_bias is not None:
            _check_count(
                "logit_bias",
                len(request.logit_bias),
                limits.max_logit_bias,
                "--max-logit-bias",
                "entries",
            )

    def request_controls(self, request: SamplingFields) -> RequestControls:
        """The request's constraint and logits controls. The constraint is checked here (400 naming the field:
        two constraints, a schema, regex or grammar the server's backend cannot parse, a model without logits);
        the logits controls' values are checked where every request's are, by SamplingParams and the input
        processor's RequestLimits (ids in the vocabulary, biases in [-100, 100]), whose errors name the field."""
        limits: RequestLimits = self.engine.input_processor.limits
        _check_backend(request.guided_decoding_backend, self.structured_outputs_backend)
        controls = RequestControls(
            structured_outputs=structured_outputs_of(request, self.structured_outputs_config),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words or None,
            logit_bias=_logit_bias(request.logit_bias),
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        if controls.structured_outputs is not None and not limits.has_logits:
            # RequestLimits refuses this too, but as `structured_outputs`; name the field the client sent.
            name = _constraint_fields(request)[0][0]
            raise OpenAIServingError(
                f"{name} needs the model's logits, and this model has none (the hash model samples its own "
                "tokens)",
                param=name,
            )
        return controls

    def truncate_prompt(
        self, text: str | None, token_ids: list[int], controls: RequestControls
    ) -> tuple[str | None, list[int]]:
        """The prompt's last `truncate_prompt_tokens` tokens (`InputProcessor.truncate`); a prompt that was cut
        loses its text (echo then shows the kept tokens, decoded)."""
        kept = self.engine.input_processor.truncate(token_ids, controls.truncate_prompt_tokens)
        return (text, token_ids) if len(kept) == len(token_ids) else (None, kept)

    def check_num_prompts(self, num_prompts: int) -> None:
        _check_count(
            "prompt", num_prompts, self.limits.max_prompts, "--max-prompts-per-request", "prompts"
        )

    def check_engine_alive(self) -> None:
        if self.engine.errored:
            raise OpenAIServingError(
                "the engine has died; restart the server",
                status_code=HTTPStatus.SERVICE_UNAVAILABLE,
            )

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert self.tokenizer is not None
        return await encode_text(self.tokenizer, text, add_special_tokens)

    def request_id(self, raw_request: Request, body_request_id: str | None) -> str:
        """The X-Request-Id header, else the body's `request_id` (vLLM), else a fresh one; 400 if it is live."""
        header_id = raw_request.headers.get(REQUEST_ID_HEADER)
        if header_id:
            self.live_requests.check_free(header_id)
            return header_id
        if body_request_id:
            self.live_requests.check_free(body_request_id, param="request_id")
            return body_request_id
        return uuid.uuid4().hex

    def max_tokens(
        self,
        requested: int | None,
        prompt_len: int,
        max_tokens_param: str,
        prompt_param: str,
    ) -> int:
        """The request's output cap: `requested`, or else what `max_model_len` leaves after the prompt, and never
        more than that or generation_config.json's max_new_tokens. 400 when the prompt, or the prompt plus
        `requested`, does not fit (vLLM's messages)."""
        remaining = self.max_model_len - prompt_len
        if remaining <= 0:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the input.",
                param=prompt_param,
            )
        if requested is not None and requested > 0 and prompt_len + requested > self.max_model_len:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, {requested} "
                "in the completion). Please reduce the length of the messages or completion.",
                param=max_tokens_param,
            )
        caps = [remaining] if requested is None else [requested]
        if self.default_max_tokens is not None:
            caps.append(self.default_max_tokens)
        return min(caps)

    def sampling_params(
        self,
        request: SamplingFields,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        fields: Iterable[str],
        aliases: Mapping[str, str],
        controls: RequestControls | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams (unset fields: the model's defaults) with its `controls`; 400 naming a bad
        field."""
        defaults = self.default_sampling_params

        def pick(name: str) -> Any:
            value = getattr(request, name)
            return getattr(defaults, name) if value is None else value

        options: dict[str, Any] = dict(
            n=request.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            repetition_penalty=pick("repetition_penalty"),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            output_kind="delta" if request.stream else "final_only",
        )
        if prompt_logprobs is not None:
            options["prompt_logprobs"] = prompt_logprobs
        if controls is not None:
            options.update(controls.options())
        try:
            return SamplingParams(**options)
        except ValueError as error:
            raise bad_request(error, set(fields), aliases) from error

    def process(
        self,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        fields: Iterable[str],
        aliases: Mapping[str, str],
    ) -> PromptInput:
        """The engine's own prompt checks (token ids in the vocabulary, logprobs within max_logprobs, ...)."""
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        if text is not None:
            prompt["prompt"] = text
        try:
            processed: ProcessedPrompt = self.engine.input_processor.process(prompt, params)
        except ValueError as error:
            raise bad_request(error, set(fields), aliases) from error
        return PromptInput(text, processed.prompt_token_ids, processed.sampling_params)

    # ------------------------------------------------------------------------------------------------ running
    async def generate(
        self,
        request_id: str,
        prompts: Sequence[PromptInput],
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run the prompts (engine ids `request_id`, or `request_id-i` for several) with `lora_request`'s adapter
        (None: the base model) and yield `(prompt index, output)` as outputs arrive. Closing or cancelling the
        iterator aborts whatever still runs."""

        # The HTTP request's trace context (only kept when the engine traces: kvflow.tracing).
        trace_headers = current_trace_headers()

        def start(index: int, engine_id: str) -> AsyncIterator[RequestOutput]:
            prompt = prompts[index]
            return self.engine.generate(
                _engine_prompt(prompt),
                prompt.sampling_params,
                engine_id,
                priority,
                lora_request=lora_request,
                trace_headers=trace_headers,
            )

        async for item in self.run_each(request_id, len(prompts), start, lora_request):
            yield item

    async def run_each(
        self,
        request_id: str,
        num_prompts: int,
        start: Callable[[int, str], AsyncIterator[RequestOutput]],
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run `start(prompt index, engine id)` for each prompt (engine ids `request_id`, or `request_id-i` for
        several) while `request_id` is live, and yield `(prompt index, output)` as outputs arrive. Closing or
        cancelling the iterator cancels what still runs. While it runs, the request holds `lora_request`'s adapter
        (`OpenAIServingModels.hold`: unloading it frees it only once every request holding it has ended)."""
        engine_ids = (
            [request_id]
            if num_prompts == 1
            else [f"{request_id}-{index}" for index in range(num_prompts)]
        )
        with (
            self.models.hold(lora_request),
            self.live_requests.claim(request_id, engine_ids),
        ):
            streams = [start(index, engine_id) for index, engine_id in enumerate(engine_ids)]
            async for item in merge_async_iterators(streams):
                yield item

    def token_texts(self, request: SamplingFields) -> TokenTexts:
        return TokenTexts(self.tokenizer, request.return_tokens_as_token_ids)


def _check_count(name: str, value: int, limit: int, flag: str, unit: str = "") -> None:
    """400 naming `name` when `value` (the field itself, or how many `unit` it holds) is over `limit`."""
    if value > limit:
        shown = f"{name} holds {value} {unit}" if unit else f"{name}={short_repr(value)}"
        raise OpenAIServingError(f"{shown}; this server takes at most {limit} ({flag})", param=name)


# ---------------------------------------------------------------------------------------------------- controls
# The request fields that each set one structured-output constraint, and the StructuredOutputsParams field each is.
_CONSTRAINT_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
_STRUCTURED_OUTPUTS_KEYS = frozenset(
    spec.name for spec in dataclasses.fields(StructuredOutputsParams)
)
# `StructuredOutputsParams.choice must be ...`, `structured_outputs.json is invalid: ...`: the leading name of a
# constraint's ValueError, and the StructuredOutputsParams field it is about.
_CONSTRAINT_ERROR = re.compile(r"^(?:StructuredOutputsParams|structured_outputs)(?:\.(\w+))?")
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


def structured_outputs_of(
    request: SamplingFields, config: StructuredOutputsConfig
) -> StructuredOutputsParams | None:
    """The request's one constraint, from whichever field sets it (`response_format`, `structured_outputs`,
    `guided_json|regex|choice|grammar`, `structural_tag`), checked against `config` (compile limits, the backend's
    parse). 400 naming the field(s): two fields setting a constraint, or one that is not valid."""
    found = _constraint_fields(request)
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise OpenAIServingError(
            f"{' and '.join(names)} each set a structured-output constraint; send exactly one of them",
            param=names[0],
        )
    [(name, options)] = found
    try:
        params = StructuredOutputsParams(**options)
        validate_structured_outputs(params, config)
    except ValueError as error:
        raise OpenAIServingError(_constraint_message(name, str(error)), param=name) from error
    return params


def _constraint_fields(request: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """`(field, StructuredOutputsParams keyword arguments)` for each request field that sets a constraint."""
    found: list[tuple[str, dict[str, Any]]] = []
    if request.response_format is not None and request.response_format.type != "text":
        found.append(("response_format", _response_format_options(request.response_format)))
    if request.structured_outputs is not None:
        found.append(
            ("structured_outputs", _structured_outputs_options(request.structured_outputs))
        )
    for name, kind in _CONSTRAINT_FIELDS.items():
        value = getattr(request, name)
        if value is None:
            continue
        if kind == "structural_tag" and isinstance(value, dict):
            value = json.dumps(value)
        found.append((name, {kind: value}))
    return found


def _response_format_options(response_format: ResponseFormat) -> dict[str, Any]:
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "structural_tag":
        return {"structural_tag": json.dumps(response_format.model_dump(exclude_none=True))}
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.json_schema is None:
        raise OpenAIServingError(
            "response_format of type json_schema needs its schema in json_schema.schema",
            param="response_format",
        )
    return {"json": json_schema.json_schema}


def _structured_outputs_options(structured_outputs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(structured_outputs) - _STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise OpenAIServingError(
            f"structured_outputs has unknown keys {unknown}; it takes "
            f"{', '.join(sorted(_STRUCTURED_OUTPUTS_KEYS))}",
            param="structured_outputs",
        )
    return dict(structured_outputs)


def _constraint_message(field: str, message: str) -> str:
    """A constraint's ValueError as the client knows the field: `StructuredOutputsParams.choice must be ...` sent as
    `guided_choice` reads `guided_choice must be ...`, `structured_outputs.json is invalid` sent as
    `response_format` reads `response_format.json_schema.schema is invalid`."""
    match = _CONSTRAINT_ERROR.match(message)
    if match is None:
        return f"{field}: {message}"
    kind = match.group(1)
    if field == "structured_outputs":
        where = f"structured_outputs.{kind}" if kind else "structured_outputs"
    elif field == "response_format" and kind == "json":
        where = "response_format.json_schema.schema"
    else:
        where = field
    return where + message[match.end() :]


def _check_backend(requested: str | None, backend: str) -> None:
    """vLLM's `guided_decoding_backend`, taken when it is "auto" or the server's own backend: kvflow compiles every
    constraint with the backend the server was started with (`--structured-outputs-config`)."""
    if requested is None or requested in ("auto", backend):
        return
    if requested not in STRUCTURED_OUTPUT_BACKENDS:
        raise OpenAIServingError(
            f"guided_decoding_backend must be one of {list(STRUCTURED_OUTPUT_BACKENDS)}, got "
            f"{short_repr(requested)}",
            param="guided_decoding_backend",
        )
    raise OpenAIServingError(
        f"guided_decoding_backend={requested!r}: kvflow has no per-request backends, and this server compiles "
        f"constraints with {backend!r}; drop the field, or start the server with "
        f'--structured-outputs-config \'{{"backend": "{requested}"}}\'',
        param="guided_decoding_backend",
    )


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `{"50256": -100}` as `{50256: -100.0}` (a key that is not an integer is a 400 naming the field;
    ids and biases are checked with the rest of the sampling fields)."""
    if not logit_bias:
        return None
    biases: dict[int, float] = {}
    for key, bias in logit_bias.items():
        if _TOKEN_ID_KEY.fullmatch(key.strip()) is None:
            raise OpenAIServingError(
                f"logit_bias keys must be token ids (integers, as strings), got {short_repr(key)}",
                param="logit_bias",
            )
        biases[int(key)] = bias
    return biases


def _engine_prompt(prompt: PromptInput) -> dict[str, Any]:
    engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt.token_ids}
    if prompt.text is not None:
        engine_prompt["prompt"] = prompt.text
    return engine_prompt


async def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; a long text is tokenized on a worker thread (the tokenizer lets the event loop run
    meanwhile), so one large prompt does not stall every other request."""
    if len(text) < LONG_TEXT_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


def raise_if_failed(output: RequestOutput) -> None:
    """An error for an output the engine ended with finish_reason "error" (the request failed alone inside a step;
    `stop_reason` holds why): 400 when the request was at fault (`CompletionOutput.client_error`: its constraint
    did not compile, or not in time), else 500."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            if completion.client_error:
                raise OpenAIServingError(str(completion.stop_reason))
            raise OpenAIServingError(
                f"the request failed in the engine: {completion.stop_reason}",
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            )


def usage_body(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int
) -> dict[str, Any]:
    """A response's `usage` as JSON-ready data, in `UsageInfo`'s field order (stream chunks send it as is)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "completion_tokens": num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def make_usage(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int
) -> UsageInfo:
    """`usage_body` as the model a whole response carries."""
    return UsageInfo.model_validate(
        usage_body(num_prompt_tokens, num_completion_tokens, num_cached_tokens)
    )


def cached_tokens(output: RequestOutput) -> int:
    return output.metrics.num_cached_tokens if output.metrics is not None else 0


# ---------------------------------------------------------------------------------------------------- streams
async def merge_async_iterators(
    iterators: Sequence[AsyncIterator[_T]],
) -> AsyncIterator[tuple[int, _T]]:
    """Yield `(i, item)` from every iterator as items arrive. Closing or cancelling the merged iterator cancels
    the ones still running (an `AsyncLLM.generate` stream aborts its request when cancelled)."""
    if len(iterators) == 1:
        async with contextlib.aclosing(iterators[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, iterator: AsyncIterator[_T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
        except Exception as error:
            queue.put_nowait((index, error))
            return
        queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(index, it)) for index, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_until_disconnected(raw_request: Request, work: Awaitable[_T]) -> _T | None:
    """Await `work`, unless the client disconnects first: then cancel it (aborting its requests) and return None.
    For responses sent whole; a streaming response notices the disconnect itself."""
    work_task = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({work_task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task.cancelled():
        logger.info("client disconnected: request aborted")
        return None
    return work_task.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
