"""LLM: the offline API. `LLM().generate("Hello", SamplingParams(max_tokens=32))`.

`LLM` is the synchronous face of the same engine that `AsyncLLM` drives: the engine core runs behind an
`EngineCoreClient` (its `EngineLoop` on a thread of this process by default; in an engine-core process of its own
with `engine_process=True`; several with `data_parallel_size > 1`), and `generate` waits for its requests' final
outputs, which the client's output handler files as they finish.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from tqdm.auto import tqdm

from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.builder import build_frontend, resolve_engine_config, start_engine_core_client
from kvflow.engine.death import EngineDeadError, fresh_dead_error
from kvflow.engine.input_processor import (
    ProcessedPrompt,
    PromptType,
    check_lora_request,
    check_priority,
    expand_lora_requests,
)
from kvflow.engine.stat_logger import LoggingStatLogger
from kvflow.entrypoints.interrupts import DeferredInterrupt
from kvflow.pooling.frontend import (
    as_classification,
    as_embedding,
    as_score,
    cosine_score,
    expand_pooling_params,
    pooled_output,
    pooling_spec_of,
    supported_tasks,
)
from kvflow.pooling.scoring import pair_prompt, pair_texts
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import BeamSearchParams, SamplingParams
from kvflow.tokenizer.chat import render_chat

if TYPE_CHECKING:
    from kvflow.beam_search import BeamSearchOutput
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
    from kvflow.engine.core import EngineCore
    from kvflow.engine.core_client import EngineCoreClient
    from kvflow.engine.output_processor import OutputProcessor
    from kvflow.lora.request import LoRARequest
    from kvflow.outputs import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from kvflow.request import Request
    from kvflow.tokenizer import Tokenizer

ChatMessages = list[dict[str, Any]]
_T = TypeVar("_T")
# How often a waiting `generate` wakes to redraw its progress bar and to take a held Ctrl-C.
_WAKE_S = 0.1


class LLM:
    """Offline batched generation on one engine.

    `model=None` is the built-in default model (created on first use, no download), a path is a Hugging Face
    checkpoint folder, `"hash"` the deterministic test model. Requests are validated whole before any is queued,
    so a bad prompt or parameter raises `ValueError` and leaves the engine untouched. Outputs come back in input
    order. `engine_process=True` runs the engine core in a process of its own and `data_parallel_size=N` runs N of
    them (both spawn processes: a script that uses them needs the `if __name__ == "__main__":` guard).

    Thread safety: any thread may call any method, at the same time as others; `generate` calls share the engine
    (their requests are batched together) and each gets its own outputs. `pause_generation`, `resume_generation`,
    `is_paused`, `reset_prefix_cache`, `update_weights` and `collective_rpc` apply between engine steps.

    Invariants: the engine core is touched only by its client's loop (never by this object); the client's handlers
    hold no reference to the `LLM`, so an `LLM` that is garbage-collected (or alive at interpreter exit) stops its
    engine; once the engine has died every call raises `EngineDeadError`.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are the `EngineArgs` options (unknown names are a TypeError, bad values a ValueError)."""
        engine_args = EngineArgs(model=model, **kwargs)
        model_info, engine_config = resolve_engine_config(engine_args)
        parts = build_frontend(engine_args, model_info, engine_config)
        self.engine_config = parts.engine_config
        self.model_info = parts.model_info
        self.tokenizer = parts.tokenizer
        self.input_processor = parts.input_processor
        self.output_processor = parts.output_processor
        self.vocab_size = self.input_processor.vocab_size
        self.eos_token_id = self.input_processor.eos_token_id
        self._request_counter = itertools.count()
        # Adapters the engine has loaded (and so checked) for this LLM: later calls naming them skip that round
        # trip (the worker reloads an evicted adapter from its folder itself).
        self._checked_loras: set[LoRARequest] = set()
        stat_logger = None if engine_args.disable_log_stats else LoggingStatLogger()
        self._outputs = _FinishedOutputs(parts.output_processor, stat_logger)
        self.engine_core_client, self.num_kv_blocks = start_engine_core_client(
            parts,
            self._outputs.on_outputs,
            self._outputs.on_dead,
            engine_args.engine_process,
            engine_args.data_parallel_size,
        )
        self._outputs.client = self.engine_core_client
        self._finalizer = weakref.finalize(self, self.engine_core_client.shutdown)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(**dataclasses.asdict(engine_args))

    # ------------------------------------------------------------------------------------------------ public
    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a `generate` call without any: kvflow's defaults overridden by the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) unless
        `generation_config="kvflow"`. A fresh copy: change it and pass it on."""
        return self.input_processor.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in input order.

        `lora_request` (needs `enable_lora=True`): the adapter every prompt runs with, or one per prompt (None: the
        base model); each adapter is loaded (and checked: a bad one is a ValueError naming what is wrong) before
        any request is queued. Prompts with different adapters share engine steps.

        A prompt is a string or `{"prompt_token_ids": [...]}` (or `{"prompt": "..."}`). `priority` (one int, or
        one per prompt; lower runs first) needs `scheduling_policy="priority"`. `use_tqdm` may be a tqdm-like
        factory. While the engine is paused the call waits (its requests are queued) and continues after
        `resume_generation`; a pause in mode "abort" finishes them with finish_reason "abort".

        Any exception or interrupt (Ctrl-C) that leaves the call aborts its requests, so their KV blocks and worker
        slots are freed and the LLM stays usable. The engine steps on its own thread (or process), so a Ctrl-C
        never interrupts a step; in the main thread it is taken while the call waits.
        """
        prompt_list = self.input_processor.normalize_prompts(prompts)
        params_list = self.input_processor.expand_sampling_params(sampling_params, len(prompt_list))
        priorities = self._expand_priority(priority, len(prompt_list))
        lora_requests = expand_lora_requests(
            lora_request, len(prompt_list), self.engine_config.lora_config is not None
        )
        self._load_adapters(lora_requests)
        processed = [
            self.input_processor.process(prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        return self._run(processed, priorities, lora_requests, use_tqdm)  # type: ignore[return-value]

    def _run(
        self,
        processed: list[ProcessedPrompt],
        priorities: list[int],
        lora_requests: list[LoRARequest | None],
        use_tqdm: bool | Callable[..., tqdm],
    ) -> list[RequestOutput | PoolingRequestOutput]:
        """Queue validated prompts as one submission and wait for all of them; their finished outputs, in order."""
        request_ids: list[str] = []
        with DeferredInterrupt() as interrupt:
            call = _Call(use_tqdm)
            try:
                # One submission for the call: the core sees every prompt before its next step.
                groups = [
                    self._make_requests(call, item, item_priority, request_ids, item_lora)
                    for item, item_priority, item_lora in zip(
                        processed, priorities, lora_requests, strict=True
                    )
                ]
                # A request the core refused fails the whole call.
                self.engine_core_client.add_request_groups(groups).result()
                self._outputs.wait(call, interrupt)
            except BaseException:
                self._abandon(call, request_ids)
                raise
            finally:
                call.close()
        return [call.finished[request_id] for request_id in request_ids]

    # ------------------------------------------------------------------------------------------------ pooling
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """("generate",) with the generate runner; with the pooling runner the model's tasks (an embedding
        model: embed, encode, score; a classifier: classify, encode, and score with one label)."""
        return supported_tasks(self.engine_config)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
        pooling_task: str = "encode",
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (runner "pooling"): one `PoolingRequestOutput` per prompt, in input order, whose
        `outputs.data` is what `pooling_task` returns ("encode": the pooled hidden state, `[num_tokens, hidden]`
        for pooling type ALL; "embed", "classify", "score": see `embed`, `classify`, `score`). A prompt may also
        be a text pair as `{"prompt_token_ids": [...], "token_type_ids": [...]}`. `pooling_params` (one for all, or
        one per prompt) give each request's settings; their `task` is `pooling_task` unless they set one.
        A prompt longer than `max_model_len` is a ValueError unless `truncate_prompt_tokens` keeps its last k
        tokens (-1: as many as fit)."""
        spec = pooling_spec_of(self.engine_config, pooling_task)
        prompt_list = self.input_processor.normalize_prompts(prompts)
        params_list = expand_pooling_params(
            pooling_params, len(prompt_list), pooling_task, truncate_prompt_tokens
        )
        priorities = self._expand_priority(priority, len(prompt_list))
        processed = [
            self.input_processor.process_pooling(prompt, params, spec)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        outputs = self._run(processed, priorities, [None] * len(processed), use_tqdm)
        return [pooled_output(output) for output in outputs]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (`.outputs.embedding`, a list of floats): the pooled hidden state cut to
        `dimensions` (Matryoshka models) and L2-normalized unless `normalize=False` (per request in
        `PoolingParams`, or the engine's `pooler_config`)."""
        return [
            as_embedding(output)
            for output in self.encode(
                prompts,
                pooling_params,
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
                priority=priority,
                pooling_task="embed",
            )
        ]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`: softmax over the labels, sigmoid for a one-label
        model; the logits with `PoolingParams(use_activation=False)`); a classifier model only."""
        return [
            as_classification(output)
            for output in self.encode(
                prompts,
                pooling_params,
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
                priority=priority,
                pooling_task="classify",
            )
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """A relevance score per text pair (`.outputs.score`), pairs made by vLLM's rules: one `data_1` against each
        `data_2` (1:N), or two lists of one length in order (N:N). A cross-encoder (a one-label classifier) reads
        each pair as one input (the tokenizer's pair template, token types 0 / 1) and scores it with its sigmoid; an
        embedding model embeds every text and scores a pair by the cosine similarity of its embeddings."""
        pairs = pair_texts(data_1, data_2)
        spec = pooling_spec_of(self.engine_config, "score")
        if spec.kind == "embed":
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            embeddings = self.encode(
                texts,
                pooling_params,
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
                pooling_task="embed",
            )
            by_text = dict(zip(texts, embeddings, strict=True))
            return [
                cosine_score(by_text[text_1], by_text[text_2], index)
                for index, (text_1, text_2) in enumerate(pairs)
            ]
        if self.tokenizer is None:
            raise ValueError(
                "score needs a tokenizer (this engine has none) to join each text pair"
            )
        prompts = [pair_prompt(self.tokenizer, text_1, text_2) for text_1, text_2 in pairs]
        return [
            as_score(output)
            for output in self.encode(
                prompts,
                pooling_params,
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
                pooling_task="score",
            )
        ]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's algorithm, `kvflow.beam_search`): one `BeamSearchOutput` per prompt
        whose `sequences` are the best `params.beam_width` beams, ranked by cumulative logprob / length **
        `length_penalty`. Each step is one `generate` call with one token per live beam, so beams share their
        prefix through the prefix cache. Needs `2 * beam_width <= max_logprobs` (a ValueError naming it). With
        `lora_request` every beam runs with that adapter."""
        from kvflow.beam_search import beam_search

        prompt_list = self.input_processor.normalize_prompts(prompts)
        token_prompts = [self.input_processor.tokenize(prompt)[1] for prompt in prompt_list]

        def step(
            beams: list[list[int]], num_logprobs: int, temperature: float
        ) -> list[RequestOutput]:
            params_one = SamplingParams(
                max_tokens=1, logprobs=num_logprobs, temperature=temperature, ignore_eos=True
            )
            return self.generate(
                [{"prompt_token_ids": tokens} for tokens in beams],
                params_one,
                use_tqdm=use_tqdm,
                lora_request=lora_request,
            )

        return beam_search(
            step, token_prompts, params, self.input_processor.eos_token_id, self.tokenizer
        )

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        chat_template: str | os.PathLike[str] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the one chat renderer (`kvflow.tokenizer.chat.render_chat`, the same as
        `kvflow chat` and `/v1/chat/completions`) and generate; vLLM's signature.

        `messages` is one conversation (a list of `{"role", "content"}` dicts; content may be OpenAI content
        parts) or a list of them. `chat_template` is a template file, the template's text, or the name of one of
        the checkpoint's templates (None: its default); `chat_template_kwargs` reach the template;
        `continue_final_message` continues the last (assistant) message instead of opening a new turn.
        `lora_request`: as `generate`'s (one adapter, or one per conversation).
        """
        if self.tokenizer is None:
            raise ValueError(
                "chat() needs a tokenizer (this LLM has skip_tokenizer_init=True or no tokenizer)"
            )
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError(
                "messages must be a non-empty list of {'role', 'content'} dicts (or a list of them)"
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = [
            render_chat(
                self.tokenizer,
                conversation,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
            ).as_prompt()
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache since the engine started (over every core)."""
        snapshots = self.scheduler_stats()
        query = sum(stats.prefix_cache_query_tokens for stats in snapshots)
        hits = sum(stats.prefix_cache_hit_tokens for stats in snapshots)
        return hits / query if query else 0.0

    def scheduler_stats(self) -> list[SchedulerStats]:
        """A snapshot of every core's scheduler now, in core order (each with its `engine_index`)."""
        snapshots = self.run_in_each_engine(_make_stats)
        for index, stats in enumerate(snapshots):
            stats.engine_index = index
        return snapshots

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.engine_core_client.reset_prefix_cache(reset_running_requests).result()

    # ------------------------------------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (ValueError naming what is wrong for a bad one); True once loaded. `generate` loads
        the adapters it is given itself: this preloads."""
        check_lora_request(lora_request, self.engine_config.lora_config is not None)
        return self.engine_core_client.add_lora(lora_request).result()

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the engine's cache (requests still running with it reload it); True if loaded."""
        self._checked_loras = {r for r in self._checked_loras if r.lora_int_id != lora_int_id}
        return self.engine_core_client.remove_lora(lora_int_id).result()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter in the engine's cache for good; False if it is not loaded."""
        return self.engine_core_client.pin_lora(lora_int_id).result()

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded in the engine's cache."""
        return self.engine_core_client.list_loras().result()

    def _load_adapters(self, lora_requests: Sequence[LoRARequest | None]) -> None:
        """Load each distinct adapter of a call not loaded before (a bad one raises before anything is queued)."""
        for lora_request in dict.fromkeys(item for item in lora_requests if item is not None):
            if lora_request not in self._checked_loras:
                self.engine_core_client.add_lora(lora_request).result()
                self._checked_loras.add(lora_request)

    # ------------------------------------------------------------------------------------------------ pause
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause (semantics: `kvflow.engine.core.Pause`). Returns once the pause has taken effect, or once a
        concurrent `resume_generation` released it."""
        self.engine_core_client.pause_generation(mode, bool(clear_cache)).result()

    def resume_generation(self) -> None:
        self.engine_core_client.resume_generation().result()

    def is_paused(self) -> bool:
        return self.engine_core_client.is_paused().result()

    def update_weights(self, weights: Any) -> int:
        """Reload weights (a checkpoint folder, or in-process a state dict) between `pause_generation` and resume;
        returns the new weight version, which outputs record (`CompletionOutput.weight_versions`)."""
        return self.engine_core_client.update_weights(weights).result()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a worker method (by name, or a callable taking the worker as its first argument) on every rank,
        between engine steps; returns the results in rank order (`EngineCore.collective_rpc`)."""
        return self.engine_core_client.collective_rpc(method, args, kwargs).result()

    def run_in_engine(self, fn: Callable[[EngineCore], _T]) -> _T:
        """Run `fn(engine_core)` where the core runs, between steps, and return its result (for inspection,
        administration and tests; with `engine_process`, `fn` and its result travel with cloudpickle)."""
        return self.engine_core_client.run(fn).result()

    def run_in_each_engine(self, fn: Callable[[EngineCore], _T]) -> list[_T]:
        """`run_in_engine` on every engine core; their results in core order."""
        return self.engine_core_client.run_each(fn).result()

    def shutdown(self) -> None:
        """Stop the engine (its loop, workers and processes); every later call raises `EngineDeadError`.
        Idempotent; an LLM that is garbage-collected or outlives the interpreter stops it too."""
        self._finalizer()

    # ------------------------------------------------------------------------------------------------ internals
    def _expand_priority(self, priority: int | Sequence[int] | None, num_prompts: int) -> list[int]:
        if priority is None:
            return [0] * num_prompts
        priorities = [priority] * num_prompts if isinstance(priority, int) else list(priority)
        if len(priorities) != num_prompts:
            raise ValueError(f"priority has {len(priorities)} entries for {num_prompts} prompts")
        policy = self.engine_config.scheduler_config.policy
        return [check_priority(value, policy) for value in priorities]

    def _make_requests(
        self,
        call: _Call,
        processed: ProcessedPrompt,
        priority: int,
        request_ids: list[str],
        lora_request: LoRARequest | None = None,
    ) -> list[Request]:
        """One prompt's requests (n children when `n > 1`) registered for `call`; its id joins `request_ids` first,
        so an abandoned call aborts it whatever happens next."""
        request_id = str(next(self._request_counter))
        requests = self.input_processor.make_requests(
            request_id, processed, time.monotonic(), priority=priority, lora_request=lora_request
        )
        request_ids.append(request_id)
        self._outputs.register(call, request_id, processed, requests)
        return requests

    def _abandon(self, call: _Call, request_ids: list[str]) -> None:
        """Abort a failed or interrupted call's requests, and wait until the core has applied the aborts. When no
        other call is waiting, also wait until nothing is in flight, so their worker slots are free too."""
        core_request_ids = self._outputs.forget(call, request_ids)
        if self.engine_core_client.dead_error is not None:
            return
        try:
            self.engine_core_client.abort_requests(core_request_ids).result()
            if self._outputs.num_calls() == 0:
                while any(self.run_in_each_engine(_has_in_flight)):
                    pass
        except EngineDeadError:
            pass


def _make_stats(engine_core: EngineCore) -> SchedulerStats:
    return engine_core.make_stats()


def _has_in_flight(engine_core: EngineCore) -> bool:
    return engine_core.has_in_flight()


class _Call:
    """One `generate` call's requests: the ids it waits for, the finished outputs it got, its progress bar."""

    def __init__(self, use_tqdm: bool | Callable[..., tqdm]) -> None:
        self.pending: set[str] = set()
        self.finished: dict[str, RequestOutput] = {}
        self.progress: _Progress | None = None if use_tqdm is False else _Progress(use_tqdm)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


class _FinishedOutputs:
    """The LLM's side of the client: files each request's final output with the call that waits for it.

    Invariants: `lock` guards the output processor and every call's state; the handlers run on the client's thread
    and hold no reference to the `LLM`; only finished requests get a RequestOutput (`finished_only`), so a step
    costs O(new tokens); a dead engine wakes every waiting call, which raises its error.
    """

    def __init__(
        self, output_processor: OutputProcessor, stat_logger: LoggingStatLogger | None
    ) -> None:
        self.output_processor = output_processor
        self.stat_logger = stat_logger
        self.client: EngineCoreClient | None = None
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.call_of: dict[str, _Call] = {}  # user request id -> the call waiting for it
        # core request id -> (its call's progress bar, its user request id)
        self.progress_of: dict[str, tuple[_Progress, str]] = {}
        self.dead_error: EngineDeadError | None = None
        self.num_waiting_calls = 0

    def register(
        self, call: _Call, request_id: str, processed: ProcessedPrompt, requests: list[Any]
    ) -> None:
        with self.lock:
            self.output_processor.add_prompt(request_id, processed, requests)
            self.call_of[request_id] = call
            call.pending.add(request_id)
            if call.progress is not None:
                call.progress.add_prompt(request_id, len(processed.prompt_token_ids))
                for request in requests:
                    self.progress_of[request.request_id] = (call.progress, request_id)

    def forget(self, call: _Call, request_ids: list[str]) -> list[str]:
        """Drop a call's requests on this side; returns their core request ids (to abort in the core)."""
        with self.lock:
            core_request_ids = [
                core_request_id
                for request_id in request_ids
                for core_request_id in self.output_processor.core_request_ids(request_id)
            ]
            self.output_processor.abort_requests(request_ids)
            for request_id in request_ids:
                self.call_of.pop(request_id, None)
            for core_request_id in core_request_ids:
                self.progress_of.pop(core_request_id, None)
            call.pending.clear()
            return core_request_ids

    def num_calls(self) -> int:
        with self.lock:
            return self.num_waiting_calls

    def wait(self, call: _Call, interrupt: DeferredInterrupt) -> None:
        """Until every request of `call` has finished; raises a held Ctrl-C, or the engine's death. The progress
        bar is drawn outside the lock (it reads counters only), so a slow bar never holds up the engine."""
        with self.lock:
            self.num_waiting_calls += 1
        try:
            while True:
                with self.lock:
                    if not call.pending:
                        break
                    if self.dead_error is not None:
                        raise fresh_dead_error(self.dead_error)
                    self.changed.wait(_WAKE_S)
                if call.progress is not None:
                    call.progress.refresh()
                interrupt.check()
            if call.progress is not None:
                call.progress.refresh()
        finally:
            with self.lock:
                self.num_waiting_calls -= 1

    # ------------------------------------------------------------------------------------------------ handlers
    def on_outputs(self, engine_outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
        """The client's output handler (one step's outputs, on the client's thread)."""
        with self.lock:
            processed = self.output_processor.process_outputs(engine_outputs, finished_only=True)
            if self.stat_logger is not None:
                self.stat_logger.record(stats, processed.iteration_stats)
            if processed.reqs_to_abort and self.client is not None:
                self.client.abort_requests(processed.reqs_to_abort)
            if self.progress_of:
                for output in engine_outputs:
                    entry = self.progress_of.get(output.request_id)
                    if entry is not None:
                        entry[0].record_output(entry[1], output)
            woke = False
            for request_output in processed.request_outputs:
                if not request_output.finished:
                    continue  # a parallel-sampling parent as one of its samples finishes
                call = self.call_of.pop(request_output.request_id, None)
                if call is None:
                    continue
                call.finished[request_output.request_id] = request_output
                call.pending.discard(request_output.request_id)
                if call.progress is not None:
                    call.progress.record_finished()
                    for core_request_id in self.output_processor.core_request_ids(
                        request_output.request_id
                    ):
                        self.progress_of.pop(core_request_id, None)
                woke = True
            if woke:
                self.changed.notify_all()

    def on_dead(self, error: EngineDeadError) -> None:
        """The client's dead handler: every waiting call raises the engine's error."""
        with self.lock:
            self.dead_error = error
            self.changed.notify_all()


class _Progress:
    """The progress bar of one `generate` call: finished requests, and input / output tokens per second, where a
    prompt's tokens count once its first output token (or a pooling request's result) arrives (it has been
    prefilled by then).

    Invariant: the client's thread only counts (under the outputs lock); the bar is drawn by the waiting call's
    thread alone (`refresh`, `close`)."""

    def __init__(self, use_tqdm: bool | Callable[..., tqdm]) -> None:
        self._make_bar = use_tqdm if callable(use_tqdm) else tqdm
        self._bar: tqdm | None = None
        self._prompt_len: dict[
            str, int
        ] = {}  # user request id -> prompt tokens, until its first output token
        self._start = time.monotonic()
        self.num_prompts = 0
        self.num_finished = 0
        self._num_shown = 0
        self.num_input_tokens = 0
        self.num_output_tokens = 0

    def add_prompt(self, request_id: str, num_prompt_tokens: int) -> None:
        self.num_prompts += 1
        self._prompt_len[request_id] = num_prompt_tokens

    def record_output(self, request_id: str, output: EngineCoreOutput) -> None:
        """One core output of user request `request_id` (the `n` samples of a prompt share its prompt: it counts
        once)."""
        if output.new_token_ids:
            self.num_output_tokens += len(output.new_token_ids)
            self.num_input_tokens += self._prompt_len.pop(request_id, 0)
        elif output.pooling_output is not None:
            # A pooling request: its prompt is done, and nothing follows.
            self.num_input_tokens += self._prompt_len.pop(request_id, 0)

    def record_finished(self) -> None:
        self.num_finished += 1

    def refresh(self) -> None:
        """Draw the bar: called by the waiting call's thread."""
        if self._bar is None:
            self._bar = self._make_bar(
                total=self.num_prompts,
                desc="Processed prompts",
                unit="req",
                dynamic_ncols=True,
            )
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(
            f"input {self.num_input_tokens / elapsed:.0f} tok/s, "
            f"output {self.num_output_tokens / elapsed:.0f} tok/s",
            refresh=False,
        )
        while (
            self._num_shown < self.num_finished
        ):  # one update per request, as a user's bar may expect
            self._num_shown += 1
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
