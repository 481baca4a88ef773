"""`kvflow bench throughput`: offline throughput of the `LLM` engine, measured and reported as vLLM's
`bench throughput` does.

Every request goes to `LLM.generate` at once, sampled (temperature 1, top-p 1) with `ignore_eos`, so each of its
`n` samples is exactly `expected_output_len` tokens long; the time is that one call's wall time. Token counts come
from the outputs (prompt tokens as the engine saw them, generated tokens of every sample).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvflow.benchmarks.datasets import SampleRequest
    from kvflow.entrypoints.llm import LLM
    from kvflow.sampling_params import SamplingParams


@dataclass(frozen=True)
class ThroughputResult:
    """One run's counts and wall time. Invariant: `total_num_tokens == total_prompt_tokens +
    total_output_tokens`, and `elapsed_time > 0`."""

    elapsed_time: float
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.total_prompt_tokens + self.total_output_tokens

    def as_json(self) -> dict[str, Any]:
        """vLLM's `--output-json` record (its keys), plus the prompt and output token counts."""
        return {
            "elapsed_time": self.elapsed_time,
            "num_requests": self.num_requests,
            "total_num_tokens": self.total_num_tokens,
            "requests_per_second": self.num_requests / self.elapsed_time,
            "tokens_per_second": self.total_num_tokens / self.elapsed_time,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
        }


def benchmark_params(output_len: int, n: int) -> SamplingParams:
    """What every benchmark request samples with (vLLM's): temperature 1, top-p 1, `n` samples of exactly
    `output_len` tokens (EOS ignored)."""
    from kvflow.sampling_params import SamplingParams

    return SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)


def check_fits(samples: Sequence[SampleRequest], max_model_len: int) -> None:
    """Every request's prompt plus output must fit `max_model_len` (ValueError naming the longest, before any
    request runs)."""
    longest = max(samples, key=lambda sample: sample.prompt_len + sample.expected_output_len)
    total = longest.prompt_len + longest.expected_output_len
    if total > max_model_len:
        raise ValueError(
            f"a request of {longest.prompt_len} prompt + {longest.expected_output_len} output tokens does not fit "
            f"max_model_len={max_model_len}: lower --input-len / --output-len or raise --max-model-len"
        )


def run_throughput(
    llm: LLM, samples: Sequence[SampleRequest], n: int, use_tqdm: bool = False
) -> ThroughputResult:
    """Generate for every sample in one `LLM.generate` call and count what came back."""
    check_fits(samples, llm.input_processor.max_model_len)
    prompts: list[Any] = [
        sample.prompt if isinstance(sample.prompt, str) else {"prompt_token_ids": sample.prompt}
        for sample in samples
    ]
    params = [benchmark_params(sample.expected_output_len, n) for sample in samples]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        elapsed_time=elapsed,
        num_requests=len(samples),
        total_prompt_tokens=sum(len(output.prompt_token_ids) for output in outputs),
        total_output_tokens=sum(
            len(completion.token_ids) for output in outputs for completion in output.outputs
        ),
    )


def format_summary(result: ThroughputResult) -> list[str]:
    """vLLM's summary lines: throughput in requests, total tokens and output tokens per second, then the token
    counts."""
    seconds = result.elapsed_time
    return [
        f"Throughput: {result.num_requests / seconds:.2f} requests/s, "
        f"{result.total_num_tokens / seconds:.2f} total tokens/s, "
        f"{result.total_output_tokens / seconds:.2f} output tokens/s",
        f"Total num prompt tokens:  {result.total_prompt_tokens}",
        f"Total num output tokens:  {result.total_output_tokens}",
    ]
