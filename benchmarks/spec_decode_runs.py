"""benchmarks/spec_decode.py's measuring side: settings and engine specs, the workloads' prompts, the step probe,
the engines, the single-stream, batch and linear-layer measurements, and the checkpoints they run on."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
