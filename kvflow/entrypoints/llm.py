"""LLM: the offline API. `LLM().generate("Hello", SamplingParams(max_tokens=32))`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvflow.engine.core import EngineCore
from kvflow.engine.output_processor import OutputProcessor, child_request_id
from kvflow.model_info import resolve_model_info
from kvflow.outputs import RequestOutput
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.worker.worker import resolve_device

if TYPE_CHECKING:
    from kvflow.tokenizer import Tokenizer

PromptType = str | dict[str, Any]
ChatMessages = list[dict[str, Any]]
# Tokens per step when not given: on CPU, chunks of ~2k tokens keep activations cache-resident (elementwise ops on
# [8192, intermediate] tensors run ~2x slower per element and matmuls lose ~10%); GPUs want bigger steps.
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


class LLM:
    """Offline batched generation on one engine.

    `model=None` is the built-in default model (created on first use, no download), a path is a Hugging Face
    checkpoint folder, `"hash"` the deterministic test model. Requests are validated whole before any is queued,
    so a bad prompt or parameter raises `ValueError` and leaves the engine untouched. Outputs come back in input
    order.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, skip_tokenizer_init: bool = False,
                 dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, async_scheduling: bool = False,
                 scheduling_policy: str = "fcfs", seed: int = 0, tensor_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, long_prefill_token_threshold: int = 0,
                 use_v2_model_runner: bool = True, device: str = "auto") -> None:
        if tensor_parallel_size != 1 or distributed_executor_backend not in (None, "uni"):
            raise ValueError("tensor_parallel_size > 1 and distributed executors are not available in this build")
        self.model_info = model_info = resolve_model_info(model)
        if max_model_len is not None and max_model_len > model_info.max_model_len:
            raise ValueError(f"max_model_len={max_model_len} is larger than the model supports "
                             f"({model_info.max_model_len})")
        max_model_len = max_model_len or model_info.max_model_len
        if max_num_batched_tokens is None:
            default_tokens = _DEFAULT_MAX_NUM_BATCHED_TOKENS[resolve_device(device).type]
            max_num_batched_tokens = default_tokens if enable_chunked_prefill else max(default_tokens, max_model_len)
        self.tokenizer = self._load_tokenizer(tokenizer, skip_tokenizer_init)
        self.vocab_size = model_info.vocab_size
        self.eos_token_id = model_info.eos_token_id
        if self.eos_token_id is None and self.tokenizer is not None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self._extra_eos_token_ids = [t for t in model_info.eos_token_ids[1:] if t != self.eos_token_id]
        self.engine_config = EngineConfig(
            model_config=ModelConfig(model=str(model_info.path) if model_info.path else model_info.name,
                                     tokenizer=tokenizer, skip_tokenizer_init=skip_tokenizer_init, dtype=dtype,
                                     max_model_len=max_model_len, seed=seed, device=device),
            cache_config=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                     kv_cache_memory_bytes=kv_cache_memory_bytes,
                                     enable_prefix_caching=enable_prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
                policy=scheduling_policy,  # type: ignore[arg-type]
                async_scheduling=async_scheduling, use_v2_model_runner=use_v2_model_runner),
            parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                           distributed_executor_backend=distributed_executor_backend),
        )
        self.engine_core = EngineCore(self.engine_config, model_info)
        capacity = self.engine_core.executor.num_kv_blocks * block_size
        if capacity < max_model_len:
            raise ValueError(f"max_model_len={max_model_len} does not fit in the KV cache ({capacity} tokens); "
                             "lower max_model_len or raise num_kv_blocks / kv_cache_memory_bytes")
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def _load_tokenizer(self, tokenizer: str | None, skip_tokenizer_init: bool) -> Tokenizer | None:
        if skip_tokenizer_init or (tokenizer is None and self.model_info.path is None):
            return None
        from kvflow.tokenizer import load_tokenizer

        return load_tokenizer(tokenizer if tokenizer is not None else self.model_info.path)

    # ------------------------------------------------------------------------------------------------ public
    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in input order.

        A prompt is a string or `{"prompt_token_ids": [...]}` (or `{"prompt": "..."}`).
        """
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params_list = self._expand_sampling_params(sampling_params, len(prompt_list))
        prepared = [self._prepare(prompt, params) for prompt, params in zip(prompt_list, params_list, strict=True)]
        request_ids = [self._add_request(prompt_text, token_ids, params) for prompt_text, token_ids, params in prepared]
        finished = self._run_to_completion(set(request_ids), use_tqdm)
        return [finished[request_id] for request_id in request_ids]

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             **chat_template_kwargs: Any) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template (or `chat_template`) and generate.

        `messages` is one conversation (a list of `{"role", "content"}` dicts) or a list of them.
        """
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer (this LLM has skip_tokenizer_init=True or no tokenizer)")
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of them)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            _check_conversation(conversation)
            text = self.tokenizer.apply_chat_template(list(conversation), chat_template=chat_template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text,
                                                                                     add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache since the engine started."""
        return self.engine_core.scheduler.prefix_cache_stats.hit_rate

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # ------------------------------------------------------------------------------------------------ internals
    @staticmethod
    def _expand_sampling_params(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                                num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(num_prompts)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            raise ValueError(f"sampling_params has {len(params_list)} entries for {num_prompts} prompts")
        return params_list

    def _prepare(self, prompt: PromptType, sampling_params: SamplingParams) -> tuple[str | None, list[int],
                                                                                      SamplingParams]:
        """Validate and tokenize one prompt; returns (prompt text, token ids, params with model EOS extras)."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        prompt_text, prompt_token_ids = self._tokenize(prompt)
        max_model_len = self.engine_config.scheduler_config.max_model_len
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len={max_model_len} leaves no "
                             "room to generate")
        if self._extra_eos_token_ids and not sampling_params.ignore_eos:
            stop_token_ids = list(sampling_params.stop_token_ids or [])
            stop_token_ids += [t for t in self._extra_eos_token_ids if t not in stop_token_ids]
            sampling_params = dataclasses.replace(sampling_params, stop_token_ids=stop_token_ids)
        return prompt_text, prompt_token_ids, sampling_params

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer (skip_tokenizer_init=True or model='hash'): "
                                 "pass {'prompt_token_ids': [...]} prompts")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise ValueError("prompt is empty after tokenization")
            return prompt, token_ids
        if not isinstance(prompt, dict) or not ({"prompt_token_ids", "prompt"} & prompt.keys()):
            raise ValueError(f"a prompt must be a string, {{'prompt_token_ids': [...]}} or {{'prompt': str}}, "
                             f"got {prompt!r}")
        if "prompt_token_ids" not in prompt:
            return self._tokenize(prompt["prompt"])
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, list | tuple) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
                raise ValueError(f"prompt_token_ids holds {token_id!r}, not a token id in [0, {self.vocab_size})")
        return prompt.get("prompt"), list(token_ids)

    def _add_request(self, prompt_text: str | None, prompt_token_ids: list[int],
                     sampling_params: SamplingParams) -> str:
        """Queue one prompt (n child requests when `n > 1`, sharing the prompt's KV through the prefix cache)."""
        request_id = str(next(self._request_counter))
        arrival_time = time.monotonic()
        if sampling_params.n == 1:
            self.engine_core.add_request(Request(request_id, prompt_token_ids, sampling_params,
                                                 eos_token_id=self.eos_token_id, arrival_time=arrival_time))
            self.output_processor.add_request(request_id, prompt_text, prompt_token_ids, sampling_params,
                                              arrival_time)
            return request_id
        parent = self.output_processor.add_parent_request(request_id, sampling_params.n, prompt_text,
                                                          prompt_token_ids, sampling_params.output_kind,
                                                          arrival_time)
        for index in range(sampling_params.n):
            child_params = dataclasses.replace(
                sampling_params, n=1, seed=None if sampling_params.seed is None else sampling_params.seed + index)
            child_id = child_request_id(request_id, index)
            self.engine_core.add_request(Request(child_id, prompt_token_ids, child_params,
                                                 eos_token_id=self.eos_token_id, arrival_time=arrival_time))
            self.output_processor.add_request(child_id, prompt_text, prompt_token_ids, child_params, arrival_time,
                                              parent=parent, index=index)
        return request_id

    def _run_to_completion(self, request_ids: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm,
                        dynamic_ncols=True)
        start, num_input_tokens, num_output_tokens = time.monotonic(), 0, 0
        while len(finished) < len(request_ids):
            engine_outputs = self.engine_core.step()
            if not engine_outputs and not self.engine_core.has_work():
                raise RuntimeError("engine went idle with requests unfinished")
            num_output_tokens += sum(len(output.new_token_ids) for output in engine_outputs)
            processed = self.output_processor.process_outputs(engine_outputs)
            if processed.reqs_to_abort:
                self.engine_core.abort_requests(processed.reqs_to_abort)
            for request_output in processed.request_outputs:
                if request_output.finished and request_output.request_id in request_ids:
                    finished[request_output.request_id] = request_output
                    num_input_tokens += len(request_output.prompt_token_ids)
                    progress.update(1)
            elapsed = max(time.monotonic() - start, 1e-9)
            progress.set_postfix_str(f"input {num_input_tokens / elapsed:.0f} tok/s, "
                                     f"output {num_output_tokens / elapsed:.0f} tok/s", refresh=False)
        progress.close()
        return finished


def _check_conversation(conversation: object) -> None:
    if not isinstance(conversation, list | tuple) or not conversation:
        raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"each message must be a dict with a 'role', got {message!r}")
