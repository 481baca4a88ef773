"""`kvflow bench latency`: the end-to-end latency of one batch through the `LLM` engine, measured and reported as
vLLM's `bench latency` does.

One batch is `batch_size` prompts of `input_len` random token ids, each sampled (temperature 1, top-p 1,
`ignore_eos`) to `n` samples of exactly `output_len` tokens; an iteration is one `LLM.generate` call on it, timed
from the call to its return. Warm-up iterations run first and are not timed.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.benchmarks.serve import percentile_of
from kvflow.benchmarks.throughput import benchmark_params

if TYPE_CHECKING:
    from kvflow.entrypoints.llm import LLM

PERCENTILES = (10, 25, 50, 75, 90, 99)
# vLLM draws dummy prompt ids below 10000; a smaller vocabulary bounds them by its size.
MAX_PROMPT_TOKEN_ID = 10000


@dataclass(frozen=True)
class LatencySettings:
    """The batch and how often it runs; every count is at least 1 (`num_iters_warmup` at least 0)."""

    input_len: int
    output_len: int
    batch_size: int
    n: int
    num_iters_warmup: int
    num_iters: int
    seed: int = 0

    def validate(self) -> None:
        """ValueError naming the first flag out of range."""
        for flag, value in (
            ("--input-len", self.input_len),
            ("--output-len", self.output_len),
            ("--batch-size", self.batch_size),
            ("--n", self.n),
            ("--num-iters", self.num_iters),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.num_iters_warmup < 0:
            raise ValueError(f"--num-iters-warmup must be >= 0, got {self.num_iters_warmup}")


def dummy_prompts(settings: LatencySettings, vocab_size: int) -> list[dict[str, list[int]]]:
    """`batch_size` token-id prompts of `input_len` random ids below min(vocab_size, MAX_PROMPT_TOKEN_ID)."""
    rng = random.Random(settings.seed)
    high = min(vocab_size, MAX_PROMPT_TOKEN_ID)
    return [
        {"prompt_token_ids": [rng.randrange(high) for _ in range(settings.input_len)]}
        for _ in range(settings.batch_size)
    ]


def measure_latencies(
    llm: LLM,
    settings: LatencySettings,
    on_iteration: Callable[[str, int], None] | None = None,
) -> list[float]:
    """Run the warm-up iterations, then time `num_iters` more; returns their latencies in seconds. `on_iteration`
    hears ("warmup" | "bench", iteration index) after each one."""
    settings.validate()
    max_model_len = llm.input_processor.max_model_len
    if settings.input_len + settings.output_len > max_model_len:
        raise ValueError(
            f"--input-len {settings.input_len} + --output-len {settings.output_len} does not fit "
            f"max_model_len={max_model_len}: lower them or raise --max-model-len"
        )
    prompts: list[Any] = dummy_prompts(settings, llm.vocab_size)
    params = benchmark_params(settings.output_len, settings.n)
    latencies = []
    for phase, count in (("warmup", settings.num_iters_warmup), ("bench", settings.num_iters)):
        for index in range(count):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if phase == "bench":
                latencies.append(time.perf_counter() - start)
            if on_iteration is not None:
                on_iteration(phase, index)
    return latencies


def latency_record(latencies: list[float]) -> dict[str, Any]:
    """vLLM's `--output-json` record: mean and (population) standard deviation, every latency, and the
    percentiles (linear interpolation, numpy's default) keyed by percentage."""
    return {
        "avg_latency": statistics.fmean(latencies),
        "std_latency": statistics.pstdev(latencies),
        "latencies": list(latencies),
        "percentiles": {
            percentage: percentile_of(latencies, percentage) for percentage in PERCENTILES
        },
    }


def format_summary(record: dict[str, Any]) -> list[str]:
    """vLLM's summary lines: the mean, the standard deviation, then one line per percentile, all in seconds."""
    lines = [
        f"Avg latency: {record['avg_latency']} seconds",
        f"Std latency: {record['std_latency']} seconds",
    ]
    lines += [
        f"{percentage}% percentile latency: {value} seconds"
        for percentage, value in record["percentiles"].items()
    ]
    return lines
