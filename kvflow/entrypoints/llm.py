"""LLM: the offline API. `LLM(model="hash").generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvflow.engine.core import EngineCore
from kvflow.engine.output_processor import OutputProcessor
from kvflow.outputs import RequestOutput
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.testing.hash_model import DEFAULT_VOCAB_SIZE

PromptType = str | dict[str, Any]
_HASH_MODEL_MAX_MODEL_LEN = 4096
_HASH_MODEL_EOS_TOKEN_ID = 50256


class LLM:
    """Offline batched generation on one engine.

    Requests are validated whole before any is queued, so a bad prompt or parameter raises `ValueError` and
    leaves the engine untouched. Outputs come back in input order.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, skip_tokenizer_init: bool = False,
                 dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, async_scheduling: bool = False,
                 scheduling_policy: str = "fcfs", seed: int = 0, tensor_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, long_prefill_token_threshold: int = 0,
                 use_v2_model_runner: bool = True) -> None:
        if model != "hash":
            raise ValueError(f"model={model!r}: only the test model 'hash' is available in this build")
        if tensor_parallel_size != 1 or distributed_executor_backend not in (None, "uni"):
            raise ValueError("tensor_parallel_size > 1 and distributed executors are not available in this build")
        max_model_len = max_model_len or _HASH_MODEL_MAX_MODEL_LEN
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(8192, max_model_len) if not enable_chunked_prefill else 8192
        self.vocab_size = DEFAULT_VOCAB_SIZE
        self.eos_token_id = _HASH_MODEL_EOS_TOKEN_ID
        self.engine_config = EngineConfig(
            model_config=ModelConfig(model=model, tokenizer=tokenizer, skip_tokenizer_init=skip_tokenizer_init,
                                     dtype=dtype, max_model_len=max_model_len, seed=seed),
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
        self.engine_core = EngineCore(self.engine_config)
        capacity = self.engine_core.executor.num_kv_blocks * block_size
        if capacity < max_model_len:
            raise ValueError(f"max_model_len={max_model_len} does not fit in the KV cache ({capacity} tokens); "
                             "lower max_model_len or raise num_kv_blocks / kv_cache_memory_bytes")
        self.output_processor = OutputProcessor()
        self._request_counter = itertools.count()

    # ------------------------------------------------------------------------------------------------ public
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in input order."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params_list = self._expand_sampling_params(sampling_params, len(prompt_list))
        requests = [self._make_request(prompt, params) for prompt, params in zip(prompt_list, params_list,
                                                                                   strict=True)]
        for request, prompt in zip(requests, prompt_list, strict=True):
            self.engine_core.add_request(request)
            self.output_processor.add_request(request.request_id, prompt if isinstance(prompt, str) else None,
                                              list(request.prompt_token_ids), request.sampling_params,
                                              request.arrival_time)
        finished = self._run_to_completion({request.request_id for request in requests}, use_tqdm)
        return [finished[request.request_id] for request in requests]

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

    def _make_request(self, prompt: PromptType, sampling_params: SamplingParams) -> Request:
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        if sampling_params.n != 1:
            raise ValueError("SamplingParams.n > 1 is not supported by this build")
        prompt_token_ids = self._tokenize(prompt)
        max_model_len = self.engine_config.scheduler_config.max_model_len
        if len(prompt_token_ids) > max_model_len:
            raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} tokens, more than "
                             f"max_model_len={max_model_len}")
        return Request(str(next(self._request_counter)), prompt_token_ids, sampling_params,
                       eos_token_id=self.eos_token_id)

    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            raise ValueError("the 'hash' model has no tokenizer: pass {'prompt_token_ids': [...]} prompts")
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {prompt!r}")
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, list | tuple) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of ints")
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
                raise ValueError(f"prompt_token_ids holds {token_id!r}, not a token id in [0, {self.vocab_size})")
        return list(token_ids)

    def _run_to_completion(self, request_ids: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm,
                        dynamic_ncols=True)
        start, num_output_tokens = time.monotonic(), 0
        while len(finished) < len(request_ids):
            engine_outputs = self.engine_core.step()
            if not engine_outputs and not self.engine_core.has_work():
                raise RuntimeError("engine went idle with requests unfinished")
            num_output_tokens += sum(len(output.new_token_ids) for output in engine_outputs)
            for request_output in self.output_processor.process_outputs(engine_outputs):
                if request_output.finished and request_output.request_id in request_ids:
                    finished[request_output.request_id] = request_output
                    progress.update(1)
            elapsed = max(time.monotonic() - start, 1e-9)
            progress.set_postfix_str(f"output {num_output_tokens / elapsed:.0f} tok/s", refresh=False)
        progress.close()
        return finished
