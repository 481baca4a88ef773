"""N-gram speculative decoding against the same engine without it, same run, interleaved.

Reproduce with `python benchmarks/spec_decode.py` (`--quick` for a seconds-long smoke run on tiny shapes;
`--json PATH` saves every figure). The speculative engines use synchronous scheduling (speculation ran only that
way when this was written; `--async-spec` adds async ones), so each is compared with two baselines: the same
engine without speculation and `async_scheduling=False` (the same scheduling: the fair comparison) and with
`async_scheduling=True` (the default a user would otherwise run).

Engines, all alive at once in this process so that runs interleave: "async" and "sync" (no speculation), and
"ngram k=K" for each `--k` (`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
"prompt_lookup_min": 1}`, synchronous scheduling); `--async-spec` adds "ngram k=K async" (speculation under async
scheduling; no step timings for those: an async step launches one batch and applies another). Each single-stream
prompt, and each batch round, runs on every engine back to back (in an order rotated each time), so every ratio
compares runs seconds apart; ratios are medians of those pairs'.
Models: the built-in default model (`LLM()`; float32) and the random-weight Qwen2-0.5B-shaped bfloat16 checkpoint
of `benchmarks/throughput.py` (same helper, same seed; its prompts are the default tokenizer's ids).

1. **Single stream**, greedy, `ignore_eos`, one request at a time, over two workloads where n-gram drafts apply:
   *heldout*: continuations of passages of `heldout_sample.txt` (text the model was not trained on); *repeat*:
   "Repeat the following passage exactly:" + a held-out passage + "The passage again:" + its first 8 tokens, so
   the continuation can copy. Default model: 3 prompts of each (160-token prompts / passages), 128 tokens; the
   0.5B-shaped checkpoint: 1 prompt of each (64-token prompt / passage), 32 tokens (its steps are ~10x slower,
   its prefill far more). 3 rounds. Decode tokens/s of a request = (tokens - 1) / (last token's time - first
   token's time), from `RequestOutput.metrics` (prefill excluded); reported: the median over requests and the
   median of each request's ratio to the baseline's run of the same prompt. Mean acceptance length (1 + accepted /
   drafts, vLLM's) comes from the scheduler's `SpecDecodingStats`, summed over the measured runs.
   **Ideal speedup** = mean acceptance length x (plain decode step's cost / cost of a step verifying k drafts):
   both costs are medians of `EngineCore.step()`'s wall time in the same runs (the "sync" engine's 1-token
   steps; the speculative engine's steps that verify exactly k drafts, proposing the next draft included). It is
   what speculation would give if every step verified a full draft at that price; measured / ideal shows what the
   rest costs: steps without a draft or with a shorter one, the front end, noise. "ideal@d" (info) is the same
   ideal at the observed share d of decode steps that carried a draft, the others costing and yielding a plain
   step's: (d L + 1 - d) / (d c_k / c_1 + 1 - d); where drafts are rare and verification dear, measured / ideal
   exceeds 1 and ideal@d is the figure to read.
   Where a verification step's time goes: the median model forward, sampling, n-gram proposal and the rest
   (scheduling, input preparation, acceptance) of those steps, and the model's linear layers alone
   (`F.linear` over its own weights with 1 and 1 + k rows, interleaved, median of 10): how much of the forward's
   growth from 1 to 1 + k tokens is the matrix products'.
2. **Batch 64**, drafts rarely accepted: 64 random-token prompts (32-128 tokens, new ones each round, the same for
   every engine), temperature 1, 32 output tokens each, `ignore_eos`, on the default model, 5 rounds; output
   tokens/s (wall time of `generate`, prefill included), median of the per-round ratios to each baseline; per
   synchronous engine, the drafts verified and tokens scheduled per step, the median step and forward.

Goals (issue 23), each a ratio from this run: >= 1.5x single-stream tokens/s on the repetitive workload (best k);
measured / ideal >= 0.8 everywhere (the worst row per model); at batch 64 with rare acceptance, speculation costs
<= 5% throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

COMMAND = "python benchmarks/spec_decode.py"
REPEAT_INSTRUCTION = "Repeat the following passage exactly:\n\n"
REPEAT_AGAIN = "\n\nThe passage again:\n\n"
# The passage's first tokens, after REPEAT_AGAIN: the continuation copies from there.
REPEAT_CUE_TOKENS = 8
PROMPT_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 1}


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Sizes of one run (`--quick` shrinks them all)."""

    ks: tuple[int, ...]
    rounds: int
    num_prompts: int  # per single-stream workload
    prompt_len: int  # heldout prompts; repeat prompts quote a passage of this many tokens
    output_len: int  # default model, single stream
    bench_prompt_len: int  # the 0.5B-shaped checkpoint, single stream (its steps are far slower)
    bench_output_len: int
    batch_size: int
    batch_output_len: int
    batch_prompt_range: tuple[int, int]
    batch_rounds: int
    linear_repeats: int  # timings of the linear layers alone, per row count

    @classmethod
    def make(cls, quick: bool, ks: tuple[int, ...] | None, rounds: int | None) -> Settings:
        if quick:
            return cls(
                ks=ks or (3,),
                rounds=rounds or 1,
                num_prompts=1,
                prompt_len=48,
                output_len=12,
                bench_prompt_len=32,
                bench_output_len=12,
                batch_size=8,
                batch_output_len=8,
                batch_prompt_range=(16, 32),
                batch_rounds=rounds or 1,
                linear_repeats=2,
            )
        return cls(
            ks=ks or (2, 3, 5),
            rounds=rounds or 3,
            num_prompts=3,
            prompt_len=160,
            output_len=128,
            bench_prompt_len=64,
            bench_output_len=32,
            batch_size=64,
            batch_output_len=32,
            batch_prompt_range=(32, 128),
            batch_rounds=rounds or 5,
            linear_repeats=10,
        )


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the comparison: a baseline (k None), n-gram speculation with k drafts, or with `draft` a
    draft model's; `disable_by_batch_size` is speculative_config's key of that name."""

    name: str
    k: int | None
    async_scheduling: bool
    draft: str | None = None
    disable_by_batch_size: int | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"async_scheduling": self.async_scheduling}
        if self.k is not None:
            config: dict[str, Any] = (
                {"method": "draft_model", "model": self.draft}
                if self.draft is not None
                else {"method": "ngram", **PROMPT_LOOKUP}
            )
            config["num_speculative_tokens"] = self.k
            if self.disable_by_batch_size is not None:
                config["disable_by_batch_size"] = self.disable_by_batch_size
            kwargs["speculative_config"] = config
        return kwargs


def engine_specs(
    ks: Sequence[int],
    async_spec: bool = False,
    draft: str | None = None,
    disable_by_batch_size: int | None = None,
) -> list[EngineSpec]:
    """The baselines, speculation with synchronous scheduling for each k, and with `async_spec` also with async
    scheduling (which runs speculation since the commit "Speculative decoding under async scheduling"); with
    `draft`, "draft k=K" engines for each k; with `disable_by_batch_size` N, "ngram k=K off@N" for the largest k
    (speculation that turns itself off in big batches)."""
    specs = [EngineSpec("async", None, True), EngineSpec("sync", None, False)]
    specs += [EngineSpec(f"ngram k={k}", k, False) for k in ks]
    if async_spec:
        specs += [EngineSpec(f"ngram k={k} async", k, True) for k in ks]
    if draft is not None:
        specs += [EngineSpec(f"draft k={k}", k, False, draft=draft) for k in ks]
    if disable_by_batch_size is not None:
        k = max(ks)
        specs.append(
            EngineSpec(
                f"ngram k={k} off@{disable_by_batch_size}",
                k,
                False,
                disable_by_batch_size=disable_by_batch_size,
            )
        )
    return specs


# ------------------------------------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class Workload:
    """Single-stream prompts (token ids), each generated greedily for exactly `output_len` tokens."""

    name: str
    prompts: list[list[int]]
    output_len: int


def heldout_text() -> str:
    from kvflow.default_model import SHIPPED_CHECKPOINT

    return (SHIPPED_CHECKPOINT / "heldout_sample.txt").read_text()


def _paragraphs(text: str) -> list[str]:
    return [paragraph.strip() for paragraph in text.split("\n\n") if len(paragraph.strip()) > 200]


def heldout_prompts(encode: Callable[[str], list[int]], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, each the start of a run of paragraphs spread over the sample."""
    paragraphs = _paragraphs(heldout_text())
    stride = len(paragraphs) // (2 * count)
    return [
        encode("\n\n".join(paragraphs[2 * i * stride : 2 * i * stride + 8]))[:length]
        for i in range(count)
    ]


def repeat_prompts(encode: Callable[[str], list[int]], count: int, length: int) -> list[list[int]]:
    """`count` prompts quoting a passage of up to `length` tokens to be repeated, ending in its first tokens
    (passages from other paragraphs than `heldout_prompts`' starts)."""
    paragraphs = _paragraphs(heldout_text())
    stride = len(paragraphs) // (2 * count)
    prompts = []
    for i in range(count):
        passage = encode(paragraphs[(2 * i + 1) * stride])[:length]
        prompts.append(
            encode(REPEAT_INSTRUCTION)
            + passage
            + encode(REPEAT_AGAIN)
            + passage[:REPEAT_CUE_TOKENS]
        )
    return prompts


def random_prompts(
    rng: random.Random, count: int, length_range: tuple[int, int], vocab_size: int
) -> list[list[int]]:
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(*length_range))] for _ in range(count)
    ]


# ------------------------------------------------------------------------------------------------ step probe
@dataclass
class StepRecord:
    """One `EngineCore.step()` that scheduled tokens: what it ran and where its wall time went."""

    num_tokens: int
    num_draft_tokens: int
    step_s: float
    forward_s: float = 0.0
    sample_s: float = 0.0
    propose_s: float = 0.0

    @property
    def other_s(self) -> float:
        return self.step_s - self.forward_s - self.sample_s - self.propose_s


class StepProbe:
    """Times each step of a synchronous engine core and the runner calls inside it (installed by wrapping
    `core.step`, `scheduler.schedule`, the model's `forward`, the runner's `_sample` and the proposer's
    `propose` on their instances; runs on the engine's thread only).

    Invariants: `records` holds one entry per step that scheduled tokens since the last `take`; the parts of a
    record were spent inside that step's `step()` call."""

    def __init__(self, core: Any) -> None:
        self.records: list[StepRecord] = []
        self._current: StepRecord | None = None
        runner = core.executor.worker.model_runner
        self._wrap(core, "step", self._timed_step)
        self._wrap(core.scheduler, "schedule", self._noting_schedule)
        self._wrap(runner.model, "forward", self._part("forward_s"))
        self._wrap(runner, "_sample", self._part("sample_s"))
        if runner.spec_decode is not None:
            # Every proposer drafts for the whole batch (a draft model's forward passes included).
            self._wrap(runner.spec_decode.proposer, "propose_batch", self._part("propose_s"))

    def take(self) -> list[StepRecord]:
        records, self.records = self.records, []
        return records

    @staticmethod
    def _wrap(
        owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        setattr(owner, name, make(getattr(owner, name)))

    def _timed_step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def timed_step() -> Any:
            self._current = None
            start = time.perf_counter()
            result = step()
            if self._current is not None:
                self._current.step_s = time.perf_counter() - start
                self.records.append(self._current)
                self._current = None
            return result

        return timed_step

    def _noting_schedule(self, schedule: Callable[[], Any]) -> Callable[[], Any]:
        def noting_schedule() -> Any:
            output = schedule()
            if output.total_num_scheduled_tokens:
                drafts = sum(map(len, output.scheduled_spec_decode_tokens.values()))
                self._current = StepRecord(output.total_num_scheduled_tokens, drafts, 0.0)
            return output

        return noting_schedule

    def _part(self, attribute: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(function: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                result = function(*args, **kwargs)
                if self._current is not None:
                    elapsed = time.perf_counter() - start
                    setattr(self._current, attribute, getattr(self._current, attribute) + elapsed)
                return result

            return timed

        return make


# ------------------------------------------------------------------------------------------------ engines
@dataclass
class Engine:
    """One `LLM` of the comparison; `probe` times its steps when its scheduling is synchronous (None otherwise)."""

    spec: EngineSpec
    llm: Any
    # Synchronous engines only (an async step launches one batch and applies another).
    probe: StepProbe | None

    def take_records(self) -> list[StepRecord]:
        if self.probe is None:
            return []
        probe = self.probe
        return self.llm.run_in_engine(lambda core: probe.take())

    def spec_stats(self) -> Any:
        stats = self.llm.run_in_engine(lambda core: core.scheduler.make_stats())
        return stats.spec_decoding_stats


def start_engines(model: str | None, specs: Sequence[EngineSpec], **kwargs: Any) -> list[Engine]:
    from kvflow import LLM

    engines = []
    for spec in specs:
        llm = LLM(model, disable_log_stats=True, **kwargs, **spec.engine_kwargs())
        probe = None if spec.async_scheduling else llm.run_in_engine(StepProbe)
        engines.append(Engine(spec, llm, probe))
    return engines


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    by %= len(items)
    return list(items[by:]) + list(items[:by])


# ------------------------------------------------------------------------------------------------ measurements
@dataclass
class Series:
    """One engine's measurements on one workload, a value per round."""

    values: list[float] = field(default_factory=list)  # tokens/s per (round, prompt) or round
    records: list[StepRecord] = field(default_factory=list)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def add_stats(self, before: Any, after: Any) -> None:
        if after is None:
            return
        delta = after - before
        self.drafts += delta.num_drafts
        self.draft_tokens += delta.num_draft_tokens
        self.accepted_tokens += delta.num_accepted_tokens


def _decode_tokens_per_s(output: Any, output_len: int) -> float:
    """(tokens - 1) / (last token's time - first token's time): decoding only, the prefill left out."""
    metrics = output.metrics
    num_tokens = len(output.outputs[0].token_ids)
    assert num_tokens == output_len, (num_tokens, output_len)
    assert metrics is not None and metrics.first_token_time and metrics.last_token_time
    return (num_tokens - 1) / (metrics.last_token_time - metrics.first_token_time)


def run_single_stream(
    engines: Sequence[Engine], workloads: Sequence[Workload], rounds: int
) -> dict[str, dict[str, Series]]:
    """Decode tokens/s of one request at a time: series[workload][engine], one value per (round, prompt). Each
    prompt runs on every engine back to back (in an order rotated per prompt and round), so a ratio compares
    runs seconds apart. An untimed short request warms each engine up first."""
    from kvflow import SamplingParams

    for engine in engines:
        warm_up = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        engine.llm.generate(
            [{"prompt_token_ids": workloads[0].prompts[0]}], warm_up, use_tqdm=False
        )
        engine.take_records()
    series = {
        workload.name: {engine.spec.name: Series() for engine in engines} for workload in workloads
    }
    turn = 0
    for _ in range(rounds):
        for workload in workloads:
            params = SamplingParams(
                max_tokens=workload.output_len, ignore_eos=True, temperature=0.0
            )
            for prompt in workload.prompts:
                for engine in rotated(engines, turn):
                    before = engine.spec_stats()
                    (output,) = engine.llm.generate(
                        [{"prompt_token_ids": prompt}], params, use_tqdm=False
                    )
                    one = series[workload.name][engine.spec.name]
                    one.values.append(_decode_tokens_per_s(output, workload.output_len))
                    one.add_stats(before, engine.spec_stats())
                    one.records += engine.take_records()
                turn += 1
    return series


def run_batch(engines: Sequence[Engine], settings: Settings, vocab_size: int) -> dict[str, Series]:
    """Output tokens/s of `batch_size` concurrent sampled requests (temperature 1) on random prompts: each round
    draws new prompts and runs them on every engine back to back, in an order rotated per round."""
    from kvflow import SamplingParams

    params = SamplingParams(max_tokens=settings.batch_output_len, ignore_eos=True, temperature=1.0)
    warm_up = random_prompts(random.Random(-1), 8, settings.batch_prompt_range, vocab_size)
    for engine in engines:
        engine.llm.generate(
            [{"prompt_token_ids": prompt} for prompt in warm_up], params, use_tqdm=False
        )
        engine.take_records()
    series = {engine.spec.name: Series() for engine in engines}
    for round_index in range(settings.batch_rounds):
        rng = random.Random(round_index)
        prompts = random_prompts(rng, settings.batch_size, settings.batch_prompt_range, vocab_size)
        for engine in rotated(engines, round_index):
            before = engine.spec_stats()
            start = time.perf_counter()
            outputs = engine.llm.generate(
                [{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False
            )
            elapsed = time.perf_counter() - start
            tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
            assert tokens == settings.batch_size * settings.batch_output_len
            one = series[engine.spec.name]
            one.values.append(tokens / elapsed)
            one.add_stats(before, engine.spec_stats())
            one.records += engine.take_records()
    return series


def linear_weights(core: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The `run_in_engine` target: (weight, bias) of every matrix a decode step reads (the embedding lookup is
    not a matrix product; a tied LM head is counted as the LM head)."""
    from kvflow.models.layers.vocab import VocabEmbedding

    weights = []
    for module in core.executor.worker.model_runner.model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, VocabEmbedding) or not isinstance(weight, torch.Tensor):
            continue
        if weight.ndim == 2:
            bias = getattr(module, "bias", None)
            weights.append((weight, bias if isinstance(bias, torch.Tensor) else None))
    return weights


def measure_linear_layers(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    row_counts: Sequence[int],
    repeats: int,
) -> dict[int, float]:
    """Median seconds of `F.linear` over all `weights` with each row count (1: a decode step; 1 + k: a
    verification step's products), the row counts interleaved; the model's own weights, so the same kernels."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    dtype = weights[0][0].dtype
    inputs = {
        rows: {
            width: torch.randn(rows, width, generator=generator).to(dtype)
            for width in {weight.shape[1] for weight, _ in weights}
        }
        for rows in row_counts
    }
    times: dict[int, list[float]] = {rows: [] for rows in row_counts}
    with torch.inference_mode():
        for repeat in range(repeats + 1):  # the first is a warm-up
            for rows in row_counts:
                start = time.perf_counter()
                for weight, bias in weights:
                    F.linear(inputs[rows][weight.shape[1]], weight, bias)
                if repeat:
                    times[rows].append(time.perf_counter() - start)
    return {rows: statistics.median(values) for rows, values in times.items()}


# ------------------------------------------------------------------------------------------------ analysis
def median_ratio(series: Series, baseline: Series) -> float:
    """The median over measurements of each one's value / the baseline's (same prompt, same round, seconds
    apart)."""
    return statistics.median(a / b for a, b in zip(series.values, baseline.values, strict=True))


@dataclass
class StepCost:
    """Median wall time of a kind of step and of its parts, in seconds, over `count` steps."""

    count: int
    step_s: float
    forward_s: float
    sample_s: float
    propose_s: float
    other_s: float

    @classmethod
    def of(cls, records: Sequence[StepRecord]) -> StepCost | None:
        if not records:
            return None

        def median(attribute: str) -> float:
            return statistics.median(getattr(record, attribute) for record in records)

        parts = ("step_s", "forward_s", "sample_s", "propose_s", "other_s")
        return cls(len(records), *(median(part) for part in parts))


def plain_decode_steps(records: Sequence[StepRecord]) -> list[StepRecord]:
    return [record for record in records if record.num_tokens == 1]


def verify_steps(records: Sequence[StepRecord], k: int) -> list[StepRecord]:
    """Single-stream steps verifying a full draft of k tokens."""
    return [
        record for record in records if record.num_draft_tokens == k and record.num_tokens == k + 1
    ]


@dataclass
class SingleStreamRow:
    """One engine on one workload of one model."""

    model: str
    workload: str
    engine: str
    k: int | None
    tokens_per_s: float
    vs_sync: float
    vs_async: float
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None
    drafted_step_share: float | None = None  # decode steps that verified a draft / all decode steps
    # Plain: its decode step; speculative: a full-draft verification step.
    step_ms: float | None = None
    ideal_speedup: float | None = None
    measured_over_ideal: float | None = None
    # The ideal at the observed share d of drafted steps (the others cost and yield a plain step's):
    # (d L + 1 - d) / (d c_k / c_1 + 1 - d). Info only: it tells a slow verification from a slow engine.
    ideal_at_draft_share: float | None = None


def single_stream_rows(
    model: str, series: dict[str, dict[str, Series]], specs: Sequence[EngineSpec]
) -> list[SingleStreamRow]:
    rows = []
    for workload, by_engine in series.items():
        sync, asynchronous = by_engine["sync"], by_engine["async"]
        plain_cost = StepCost.of(plain_decode_steps(sync.records))
        for spec in specs:
            one = by_engine[spec.name]
            row = SingleStreamRow(
                model,
                workload,
                spec.name,
                spec.k,
                one.median,
                median_ratio(one, sync),
                median_ratio(one, asynchronous),
            )
            if spec.name == "sync" and plain_cost is not None:
                row.step_ms = 1e3 * plain_cost.step_s
            if spec.k is not None:
                verify_cost = StepCost.of(verify_steps(one.records, spec.k))
                row.mean_acceptance_length = one.mean_acceptance_length
                row.acceptance_rate = one.acceptance_rate
                decode_records = [
                    record for record in one.records if record.num_tokens <= spec.k + 1
                ]
                if decode_records:
                    drafted = sum(1 for record in decode_records if record.num_draft_tokens)
                    row.drafted_step_share = drafted / len(decode_records)
                if verify_cost is not None and plain_cost is not None and one.drafts:
                    row.step_ms = 1e3 * verify_cost.step_s
                    assert row.mean_acceptance_length is not None
                    row.ideal_speedup = (
                        row.mean_acceptance_length * plain_cost.step_s / verify_cost.step_s
                    )
                    row.measured_over_ideal = row.vs_sync / row.ideal_speedup
                    if row.drafted_step_share is not None:
                        share = row.drafted_step_share
                        row.ideal_at_draft_share = (
                            share * row.mean_acceptance_length + 1 - share
                        ) / (share * verify_cost.step_s / plain_cost.step_s + 1 - share)
            rows.append(row)
    return rows


def step_breakdown(
    series: dict[str, dict[str, Series]], specs: Sequence[EngineSpec]
) -> dict[str, StepCost | None]:
    """Per engine, over all its workloads: the plain decode step ("sync") and full-draft verification steps."""
    breakdown: dict[str, StepCost | None] = {}
    for spec in specs:
        if spec.async_scheduling:
            continue
        records = [
            record for by_engine in series.values() for record in by_engine[spec.name].records
        ]
        if spec.k is None:
            breakdown[spec.name] = StepCost.of(plain_decode_steps(records))
        else:
            breakdown[spec.name] = StepCost.of(verify_steps(records, spec.k))
    return breakdown


@dataclass
class BatchRow:
    """One engine at batch 64; the step figures need a probe (synchronous engines), else None."""

    engine: str
    k: int | None
    tokens_per_s: float
    vs_sync: float
    vs_async: float
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    drafts_per_step: float | None  # requests verifying a draft per step (of up to the batch size)
    tokens_per_step: float | None  # scheduled tokens per step, mean (prefill chunks included)
    step_ms: float | None  # median step
    forward_ms: float | None  # median model forward of a step


def batch_rows(series: dict[str, Series], specs: Sequence[EngineSpec]) -> list[BatchRow]:
    rows = []
    for spec in specs:
        one = series[spec.name]
        drafts_per_step = one.drafts / len(one.records) if one.records and spec.k else None
        records = one.records
        tokens = statistics.mean(r.num_tokens for r in records) if records else None
        cost = StepCost.of(records)
        rows.append(
            BatchRow(
                spec.name,
                spec.k,
                one.median,
                median_ratio(one, series["sync"]),
                median_ratio(one, series["async"]),
                one.mean_acceptance_length,
                one.acceptance_rate,
                drafts_per_step,
                tokens,
                None if cost is None else 1e3 * cost.step_s,
                None if cost is None else 1e3 * cost.forward_s,
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------ goals
@dataclass
class Goal:
    """One row of the goals table; `measured` None when it could not be measured (SKIP)."""

    name: str
    measured: float | None
    comparison: str  # ">=" or "<="
    target: float

    @property
    def status(self) -> str:
        if self.measured is None:
            return "SKIP"
        if self.comparison == ">=":
            return "PASS" if self.measured >= self.target else "MISS"
        return "PASS" if self.measured <= self.target else "MISS"


def goals_for(
    single: Sequence[SingleStreamRow], batch: Sequence[BatchRow], models: Sequence[str]
) -> list[Goal]:
    goals = []
    for model in models:
        repeat = [
            row for row in single if row.model == model and row.workload == "repeat" and row.k
        ]
        best = max(repeat, key=lambda row: row.vs_sync)
        goals.append(Goal(f"{model}: repeat tok/s, {best.engine} / sync", best.vs_sync, ">=", 1.5))
        best_async = max(repeat, key=lambda row: row.vs_async)
        goals.append(
            Goal(
                f"{model}: repeat tok/s, {best_async.engine} / async",
                best_async.vs_async,
                ">=",
                1.5,
            )
        )
    for model in models:
        rated = [
            row
            for row in single
            if row.model == model and row.k and row.measured_over_ideal is not None
        ]
        worst = min(rated, key=lambda row: row.measured_over_ideal or 0.0, default=None)
        name = f"{model}: measured/ideal"
        if worst is not None:
            name += f", worst ({worst.workload} {worst.engine})"
        goals.append(Goal(name, None if worst is None else worst.measured_over_ideal, ">=", 0.8))
    for row in batch:
        if row.k is not None:
            goals.append(Goal(f"batch cost vs sync, {row.engine}", 1.0 - row.vs_sync, "<=", 0.05))
            goals.append(Goal(f"batch cost vs async, {row.engine}", 1.0 - row.vs_async, "<=", 0.05))
    return goals


# ------------------------------------------------------------------------------------------------ report
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _engine_width(names: Iterable[str]) -> int:
    return max(len(name) for name in names) + 2


def format_single_stream(rows: Sequence[SingleStreamRow]) -> str:
    width = _engine_width(row.engine for row in rows)
    header = (
        f"{'model':<11}{'workload':<9}{'engine':<{width}}{'tok/s':>8}{'/sync':>7}{'/async':>7}{'acc len':>8}"
        f"{'acc %':>7}{'drafted':>8}{'step ms':>8}{'ideal':>7}{'meas/ideal':>11}{'ideal@d':>8}"
    )
    lines = [header]
    for row in rows:
        rate = None if row.acceptance_rate is None else 100 * row.acceptance_rate
        share = None if row.drafted_step_share is None else 100 * row.drafted_step_share
        lines.append(
            f"{row.model:<11}{row.workload:<9}{row.engine:<{width}}{row.tokens_per_s:>8.1f}{row.vs_sync:>7.3f}"
            f"{row.vs_async:>7.3f}{_fmt(row.mean_acceptance_length, '.2f'):>8}{_fmt(rate, '.1f'):>7}"
            f"{_fmt(share, '.0f'):>7}%{_fmt(row.step_ms, '.2f'):>8}{_fmt(row.ideal_speedup, '.2f'):>7}"
            f"{_fmt(row.measured_over_ideal, '.3f'):>11}{_fmt(row.ideal_at_draft_share, '.2f'):>8}"
        )
    return "\n".join(lines)


def format_breakdown(
    model: str,
    breakdown: dict[str, StepCost | None],
    linear_s: dict[int, float],
    specs: Sequence[EngineSpec],
) -> str:
    """The median step and its parts, then how much the forward pass and the linear layers alone grow from 1
    token to 1 + k (`linear_s`: `measure_linear_layers`)."""
    width = _engine_width(breakdown)
    lines = [
        f"{model}: median ms per step (sync: 1-token steps, ngram: k-draft verification); "
        "x = (1 + k tokens) / 1 token",
        f"  {'engine':<{width}}{'steps':>7}{'step':>8}{'forward':>9}{'sample':>8}{'propose':>9}{'other':>8}"
        f"{'fwd x':>7}{'linear ms':>10}{'linear x':>9}",
    ]
    plain = breakdown.get("sync")
    k_of = {spec.name: spec.k or 0 for spec in specs}
    for name, cost in breakdown.items():
        rows = 1 + k_of[name]
        linear = linear_s.get(rows)
        linear_x = None if linear is None or 1 not in linear_s else linear / linear_s[1]
        linear_text = (
            f"{_fmt(None if linear is None else 1e3 * linear, '.2f'):>10}{_fmt(linear_x, '.2f'):>9}"
        )
        if cost is None:
            lines.append(f"  {name:<{width}}{0:>7}{'-':>8}{'':>34}{'-':>7}{linear_text}")
            continue
        forward_x = None if plain is None else cost.forward_s / plain.forward_s
        lines.append(
            f"  {name:<{width}}{cost.count:>7}{1e3 * cost.step_s:>8.2f}{1e3 * cost.forward_s:>9.2f}"
            f"{1e3 * cost.sample_s:>8.2f}{1e3 * cost.propose_s:>9.3f}{1e3 * cost.other_s:>8.2f}"
            f"{_fmt(forward_x, '.2f'):>7}{linear_text}"
        )
    return "\n".join(lines)


def format_batch(rows: Sequence[BatchRow]) -> str:
    width = _engine_width(row.engine for row in rows)
    lines = [
        f"{'engine':<{width}}{'tok/s':>9}{'/sync':>7}{'/async':>7}{'acc len':>8}{'acc %':>7}{'drafts/step':>12}"
        f"{'tokens/step':>12}{'step ms':>8}{'fwd ms':>8}"
    ]
    for row in rows:
        rate = None if row.acceptance_rate is None else 100 * row.acceptance_rate
        lines.append(
            f"{row.engine:<{width}}{row.tokens_per_s:>9.1f}{row.vs_sync:>7.3f}{row.vs_async:>7.3f}"
            f"{_fmt(row.mean_acceptance_length, '.2f'):>8}{_fmt(rate, '.1f'):>7}"
            f"{_fmt(row.drafts_per_step, '.1f'):>12}{_fmt(row.tokens_per_step, '.1f'):>12}"
            f"{_fmt(row.step_ms, '.2f'):>8}{_fmt(row.forward_ms, '.2f'):>8}"
        )
    return "\n".join(lines)


def format_goals(goals: Sequence[Goal]) -> str:
    lines = [f"{'goal':<56}{'measured':>10}{'target':>9}  status"]
    for goal in goals:
        lines.append(
            f"{goal.name:<56}{_fmt(goal.measured, '.3f'):>10}{goal.comparison + ' ' + format(goal.target, 'g'):>9}"
            f"  {goal.status}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ checkpoints
def write_quick_checkpoint(path: Path, shape: dict[str, int]) -> Path:
    """A random bfloat16 Qwen2 checkpoint of `shape` written with safetensors alone (seconds faster than
    building it through transformers, which matters to the smoke run); created once and reused."""
    from safetensors.torch import save_file

    marker = path / "kvflow-benchmark.json"
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        return path
    hidden, intermediate = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv_width = shape["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return (0.02 * torch.randn(*size, generator=generator)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": randn(shape["vocab_size"], hidden)}
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for name, rows in (("q", hidden), ("k", kv_width), ("v", kv_width)):
            tensors[f"{prefix}self_attn.{name}_proj.weight"] = randn(rows, hidden)
            tensors[f"{prefix}self_attn.{name}_proj.bias"] = randn(rows)
        tensors[f"{prefix}self_attn.o_proj.weight"] = randn(hidden, hidden)
        tensors[f"{prefix}mlp.gate_proj.weight"] = randn(intermediate, hidden)
        tensors[f"{prefix}mlp.up_proj.weight"] = randn(intermediate, hidden)
        tensors[f"{prefix}mlp.down_proj.weight"] = randn(hidden, intermediate)
        tensors[f"{prefix}input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[f"{prefix}post_attention_layernorm.weight"] = torch.ones(
            hidden, dtype=torch.bfloat16
        )
    config = {
        **shape,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text(json.dumps(shape))
    return path


def bench_checkpoint(quick: bool, checkpoint_dir: Path | None) -> Path:
    from benchmarks import throughput

    cache_root = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    if quick:
        return write_quick_checkpoint(
            checkpoint_dir or cache_root / "bench-spec-quick", throughput.QUICK_SHAPE
        )
    return throughput.ensure_checkpoint(
        checkpoint_dir or cache_root / "bench-qwen2-0.5b-shape", throughput.QWEN2_05B_SHAPE
    )


# ------------------------------------------------------------------------------------------------ main
def describe_cpu() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs"


@contextmanager
def _stage(name: str) -> Iterator[None]:
    """Say on stderr what is being measured and how long it took (the report goes to stdout)."""
    print(f"{name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


@dataclass
class ModelRun:
    """Everything measured on one model."""

    label: str
    specs: Sequence[EngineSpec]
    single_stream: dict[str, dict[str, Series]]
    batch: dict[str, Series] | None = None
    # Row count -> seconds of the linear layers alone (`measure_linear_layers`).
    linear_s: dict[int, float] = field(default_factory=dict)


def measure_model(
    label: str,
    model: str | None,
    engine_kwargs: dict[str, Any],
    make_workloads: Callable[[Any], list[Workload]],
    specs: Sequence[EngineSpec],
    settings: Settings,
    batch_vocab_size: int | None = None,
) -> tuple[ModelRun, Any]:
    """Start every engine on `model`, run the single-stream workloads (and the batch one when
    `batch_vocab_size` is given), shut them down. Returns the run and the first engine's tokenizer."""
    with _stage(f"{label}: starting {len(specs)} engines"):
        engines = start_engines(model, specs, **engine_kwargs)
    try:
        tokenizer = engines[0].llm.get_tokenizer()
        workloads = make_workloads(tokenizer)
        with _stage(f"{label}: single stream"):
            run = ModelRun(label, specs, run_single_stream(engines, workloads, settings.rounds))
        if batch_vocab_size is not None:
            with _stage(f"{label}: batch {settings.batch_size}"):
                run.batch = run_batch(engines, settings, batch_vocab_size)
        with _stage(f"{label}: linear layers alone"):
            sync = next(engine for engine in engines if engine.spec.name == "sync")
            row_counts = [1] + [1 + k for k in settings.ks]
            weights = sync.llm.run_in_engine(linear_weights)
            run.linear_s = measure_linear_layers(weights, row_counts, settings.linear_repeats)
    finally:
        for engine in engines:
            engine.llm.shutdown()
    return run, tokenizer


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, short runs (smoke run)")
    parser.add_argument("--k", default=None, help="comma-separated draft lengths (default 2,3,5)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds (default 3 single-stream, 5 batch)",
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="the benchmark checkpoint"
    )
    parser.add_argument("--skip-bench-model", action="store_true", help="the default model only")
    parser.add_argument(
        "--async-spec",
        action="store_true",
        help="also run each k with async scheduling ('ngram k=K async')",
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="also run 'draft k=K' engines with this draft model on the default model (e.g. default-draft)",
    )
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="also run 'ngram k=MAX off@N' (speculative_config disable_by_batch_size N)",
    )
    parser.add_argument("--json", type=Path, default=None, help="save every figure here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    ks = tuple(int(k) for k in args.k.split(",")) if args.k else None
    settings = Settings.make(args.quick, ks, args.rounds)
    specs = engine_specs(settings.ks, args.async_spec, args.draft, args.disable_by_batch_size)
    max_model_len = 2 * settings.prompt_len + settings.output_len + 64

    def default_workloads(tokenizer: Any) -> list[Workload]:
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        count, length, output_len = settings.num_prompts, settings.prompt_len, settings.output_len
        return [
            Workload("heldout", heldout_prompts(encode, count, length), output_len),
            Workload("repeat", repeat_prompts(encode, count, length), output_len),
        ]

    num_blocks = settings.batch_size * -(-max_model_len // 16)
    default_run, tokenizer = measure_model(
        "default",
        None,
        {
            "max_model_len": max_model_len,
            "max_num_seqs": settings.batch_size,
            "num_kv_blocks": num_blocks,
        },
        default_workloads,
        specs,
        settings,
        batch_vocab_size=tokenizer_vocab_size(None),
    )
    runs = [default_run]
    bench_path = None
    if not args.skip_bench_model:
        bench_path = bench_checkpoint(args.quick, args.checkpoint_dir)
        bench_vocab = json.loads((bench_path / "config.json").read_text())["vocab_size"]

        def bench_workloads(_: Any) -> list[Workload]:
            """The default tokenizer's ids (the checkpoint has none; ids wrap into a smaller vocabulary)."""

            def encode(text: str) -> list[int]:
                return [
                    token % bench_vocab
                    for token in tokenizer.encode(text, add_special_tokens=False)
                ]

            length, output_len = settings.bench_prompt_len, settings.bench_output_len
            return [
                Workload("heldout", heldout_prompts(encode, 1, length), output_len),
                Workload("repeat", repeat_prompts(encode, 1, length), output_len),
            ]

        bench_run, _ = measure_model(
            "0.5B-bf16" if not args.quick else "tiny-bf16",
            str(bench_path),
            {
                "dtype": "bfloat16",
                "skip_tokenizer_init": True,
                "max_model_len": max_model_len,
                "max_num_seqs": 1,
                "num_kv_blocks": 2 * -(-max_model_len // 16),
            },
            bench_workloads,
            # A draft shares the default model's vocabulary, not this checkpoint's.
            [spec for spec in specs if spec.draft is None],
            settings,
        )
        runs.append(bench_run)
    return report(args, argv, settings, specs, runs, bench_path)


def tokenizer_vocab_size(model: str | None) -> int:
    """The vocabulary size in `model`'s config.json (None: the built-in default model)."""
    if model is None:
        from kvflow.default_model import ensure_default_model

        model = str(ensure_default_model())
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def report(
    args: argparse.Namespace,
    argv: list[str] | None,
    settings: Settings,
    specs: Sequence[EngineSpec],
    runs: Sequence[ModelRun],
    bench_path: Path | None,
) -> dict[str, Any]:
    argv_shown = argv if argv is not None else sys.argv[1:]
    threads = torch.get_num_threads()
    single = [
        row for run in runs for row in single_stream_rows(run.label, run.single_stream, run.specs)
    ]
    breakdowns = {run.label: step_breakdown(run.single_stream, run.specs) for run in runs}
    batch_run = next(run for run in runs if run.batch is not None)
    assert batch_run.batch is not None
    batch = batch_rows(batch_run.batch, batch_run.specs)
    goals = goals_for(single, batch, [run.label for run in runs])

    print(f"# {COMMAND} {shlex.join(argv_shown)}")
    print(
        f"# {describe_cpu()}, torch {torch.__version__}, {threads} threads; {settings.rounds} rounds"
    )
    print(
        f"# single stream: greedy, default model {settings.num_prompts} prompt(s) x {settings.output_len} "
        f"tokens per workload, bench checkpoint {bench_path or '-'} 1 prompt x {settings.bench_output_len}; "
        "tok/s: median over requests; /sync, /async: median of per-request ratios"
    )
    print(format_single_stream(single))
    for run in runs:
        print(format_breakdown(run.label, breakdowns[run.label], run.linear_s, run.specs))
    print(
        f"batch {settings.batch_size} ({batch_run.label} model, random prompts {settings.batch_prompt_range}, "
        f"temperature 1, {settings.batch_output_len} tokens each):"
    )
    print(format_batch(batch))
    print(format_goals(goals))

    results: dict[str, Any] = {
        "command": f"{COMMAND} {shlex.join(argv_shown)}",
        "machine": describe_cpu(),
        "torch": torch.__version__,
        "threads": threads,
        "settings": asdict(settings),
        "bench_checkpoint": None if bench_path is None else str(bench_path),
        "single_stream": [asdict(row) for row in single],
        "single_stream_rounds": {
            run.label: {
                workload: {engine: one.values for engine, one in by_engine.items()}
                for workload, by_engine in run.single_stream.items()
            }
            for run in runs
        },
        "step_breakdown": {
            label: {
                name: None if cost is None else asdict(cost) for name, cost in breakdown.items()
            }
            for label, breakdown in breakdowns.items()
        },
        "linear_layers_s": {run.label: run.linear_s for run in runs},
        "batch": [asdict(row) for row in batch],
        "batch_rounds": {engine: one.values for engine, one in batch_run.batch.items()},
        "goals": [{**asdict(goal), "status": goal.status} for goal in goals],
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
