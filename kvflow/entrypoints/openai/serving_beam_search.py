"""Beam search on /v1/completions and /v1/chat/completions (`use_beam_search: true`), vLLM's contract.

`n` is the beam width and the number of choices: each prompt's best `n` beams, best first (completions: choice
`p * n + i` is prompt p's i-th best; chat: index 0..n-1), ranked by cumulative logprob / length ** `length_penalty`.
Each prompt runs `AsyncLLM.beam_search` (its steps are one-token requests, one per live beam, sharing prefixes
through the prefix cache) with the request's `max_tokens` / `max_completion_tokens`, `temperature` (unset: 0, as
`BeamSearchParams` and vLLM's offline beam search have it, not the model's sampling default), `ignore_eos` and
`include_stop_str_in_output`. A beam's `finish_reason` is "stop" (EOS) or "length" ("abort" when the search was
aborted); `usage` counts each prompt once and every returned beam's tokens.

`beam_search_results` stands where `OpenAIServing.generate` stands for sampling: it yields each prompt's beams as
one finished `RequestOutput` (beam i is `outputs[i]`), so an endpoint builds its response from them with the code
it uses for samples. The prompt fields (`truncate_prompt_tokens`, `add_special_tokens`, the chat template
fields) and the output fields (`echo`, `return_token_ids`, `return_tokens_as_token_ids`, `skip_special_tokens`,
`priority`, chat's reasoning and "auto" tool-call parsing, `logprobs` / `top_logprobs`) therefore work as without
beam search; a beam's logprobs are those of its chosen tokens among the `2 * n` candidates of each step, so at
most `2 * n` top logprobs can be asked for. The fields beam search would ignore (sampling filters and
penalties, seeds, stop conditions, constraints, prompt logprobs, streaming) are refused with it, each a 400
naming it (`unsupported.BEAM_SEARCH_FIELDS`), as are a forced tool call (`tool_choice` "required" or named: a
constraint) and `echo` with completions' `logprobs` (that needs the prompt's logprobs).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from kvflow.beam_search import beam_text, step_sampling_params
from kvflow.entrypoints.openai.errors import OpenAIServingError, bad_request
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.sampling_params import BeamSearchParams

if TYPE_CHECKING:
    from kvflow.beam_search import BeamSearchOutput, BeamSearchSequence
    from kvflow.entrypoints.openai.serving_engine import OpenAIServing, PromptInput
    from kvflow.lora.request import LoRARequest

BeamSearchRequest = CompletionRequest | ChatCompletionRequest


def beam_search_results(
    serving: OpenAIServing,
    request: BeamSearchRequest,
    request_id: str,
    prompts: Sequence[PromptInput],
    lora_request: LoRARequest | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Beam search for every prompt (checked, tokenized and capped by the endpoint, as for sampling), run
    concurrently once iterated, as `OpenAIServing.generate` runs requests: the same engine ids (`request_id`, or
    `request_id-i` for several prompts; live in `serving.live_requests`, so /abort_requests reaches them) and
    `(prompt index, output)` per prompt when its search ends. Closing or cancelling the iterator aborts the
    searches still running. The request is checked here, before anything runs (400 naming the field: see
    `beam_search_params`). With a LoRA adapter (`lora_request`) every beam runs with it."""
    params = beam_search_params(serving, request, prompts)
    return _run(serving, request_id, prompts, params, request.priority, lora_request)


def beam_search_params(
    serving: OpenAIServing, request: BeamSearchRequest, prompts: Sequence[PromptInput]
) -> list[BeamSearchParams]:
    """Each prompt's BeamSearchParams (its `max_tokens` as the prompt's checks capped it). 400 naming the field:
    a model without logits (`use_beam_search`), a forced tool call (`tool_choice`), `2 * n` logprobs over the
    engine's `max_logprobs` (`n`), more top logprobs than the `2 * n` candidates (`logprobs` / `top_logprobs`),
    completions' `echo` with `logprobs`."""
    limits = serving.engine.input_processor.limits
    if not limits.has_logits:
        raise OpenAIServingError(
            "use_beam_search needs the model's logprobs, and this model has none (the hash model samples its "
            "own tokens)",
            param="use_beam_search",
        )
    # The request's own constraint fields are refused before its prompt is built; what is left is chat's.
    if any(prompt.sampling_params.structured_outputs is not None for prompt in prompts):
        raise OpenAIServingError(
            "tool_choice 'required' or a named function constrains the reply to a tool call, and beam search "
            "does not constrain its beams; send tool_choice 'auto' or 'none'",
            param="tool_choice",
        )
    params = [_params(request, prompt.sampling_params.max_tokens) for prompt in prompts]
    num_candidates = 2 * request.n
    try:
        limits.check_params(step_sampling_params(params[0]))
    except ValueError as error:
        raise OpenAIServingError(
            f"n={request.n}: beam search asks each step for 2 * n = {num_candidates} logprobs, and "
            + str(error).removeprefix("SamplingParams."),
            param="n",
        ) from error
    _check_top_logprobs(request, num_candidates)
    return params


def _params(request: BeamSearchRequest, max_tokens: int) -> BeamSearchParams:
    try:
        return BeamSearchParams(
            beam_width=request.n,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=0.0 if request.temperature is None else request.temperature,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
    except ValueError as error:
        max_tokens_param = (
            "max_completion_tokens"
            if getattr(request, "max_completion_tokens", None) is not None
            else "max_tokens"
        )
        message = ValueError(str(error).removeprefix("BeamSearchParams."))
        aliases = {"beam_width": "n", "max_tokens": max_tokens_param}
        raise bad_request(message, set(type(request).model_fields), aliases) from error


def _check_top_logprobs(request: BeamSearchRequest, num_candidates: int) -> None:
    """A beam's logprobs are its steps' `num_candidates` candidates: no more top logprobs are known."""
    if isinstance(request, ChatCompletionRequest):
        name, num_top = "top_logprobs", (request.top_logprobs or 0) if request.logprobs else None
    else:
        name, num_top = "logprobs", request.logprobs
        if request.echo and num_top is not None:
            raise OpenAIServingError(
                "echo with logprobs needs the prompt's logprobs, which beam search does not compute; drop echo "
                "or logprobs",
                param="echo",
            )
    if num_top is not None and num_top > num_candidates:
        raise OpenAIServingError(
            f"{name}={num_top}: a beam's tokens were chosen among 2 * n = {num_candidates} candidates, so at "
            f"most {num_candidates} top logprobs are known",
            param=name,
        )


async def _run(
    serving: OpenAIServing,
    request_id: str,
    prompts: Sequence[PromptInput],
    params: Sequence[BeamSearchParams],
    priority: int,
    lora_request: LoRARequest | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    def start(index: int, engine_id: str) -> AsyncIterator[RequestOutput]:
        return _search(serving, engine_id, prompts[index], params[index], priority, lora_request)

    async for item in serving.run_each(request_id, len(prompts), start):
        yield item


async def _search(
    serving: OpenAIServing,
    request_id: str,
    prompt: PromptInput,
    params: BeamSearchParams,
    priority: int,
    lora_request: LoRARequest | None = None,
) -> AsyncIterator[RequestOutput]:
    arrival_time = time.time()
    output = await serving.engine.beam_search(
        {"prompt_token_ids": prompt.token_ids}, request_id, params, priority, lora_request
    )
    yield beam_search_request_output(serving, request_id, prompt, params, output, arrival_time)


def beam_search_request_output(
    serving: OpenAIServing,
    request_id: str,
    prompt: PromptInput,
    params: BeamSearchParams,
    output: BeamSearchOutput,
    arrival_time: float,
) -> RequestOutput:
    """A prompt's beams as one finished RequestOutput (vLLM's shape): beam i is `outputs[i]`, with its generated
    tokens (a final EOS included), their logprobs and its text (special tokens kept where the prompt's params
    ask for them)."""
    outputs = [
        CompletionOutput(
            index=index,
            text=_text(serving, prompt, params, beam),
            token_ids=beam.tokens[len(prompt.token_ids) :],
            finish_reason=beam.finish_reason,
            logprobs=beam.logprobs,
            cumulative_logprob=beam.cum_logprob,
        )
        for index, beam in enumerate(output.sequences)
    ]
    metrics = RequestMetrics(
        arrival_time=arrival_time,
        finished_time=time.time(),
        num_cached_tokens=output.num_cached_tokens,
    )
    return RequestOutput(
        request_id, prompt.text, prompt.token_ids, outputs, finished=True, metrics=metrics
    )


def _text(
    serving: OpenAIServing, prompt: PromptInput, params: BeamSearchParams, beam: BeamSearchSequence
) -> str:
    """The beam's text as the search decoded it, or decoded again keeping special tokens where the prompt's
    params ask for them (`skip_special_tokens: false`, or a tool-call parser whose markers are special)."""
    if prompt.sampling_params.skip_special_tokens or serving.tokenizer is None:
        return beam.text or ""
    return beam_text(
        beam, len(prompt.token_ids), serving.tokenizer, params, skip_special_tokens=False
    )
