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
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# The parts live in sibling modules; this script's namespace re-exports them (tests use `benchmarks.spec_decode`).
from benchmarks.spec_decode_report import (
    BatchRow,
    Goal,
    SingleStreamRow,
    StepCost,
    batch_rows,
    format_batch,
    format_breakdown,
    format_goals,
    format_single_stream,
    goals_for,
    median_ratio,
    plain_decode_steps,
    single_stream_rows,
    step_breakdown,
    verify_steps,
)
from benchmarks.spec_decode_runs import (
    PROMPT_LOOKUP,
    REPEAT_AGAIN,
    REPEAT_CUE_TOKENS,
    REPEAT_INSTRUCTION,
    Engine,
    EngineSpec,
    Series,
    Settings,
    StepProbe,
    StepRecord,
    Workload,
    bench_checkpoint,
    engine_specs,
    heldout_prompts,
    heldout_text,
    linear_weights,
    measure_linear_layers,
    random_prompts,
    repeat_prompts,
    rotated,
    run_batch,
    run_single_stream,
    start_engines,
    write_quick_checkpoint,
)

COMMAND = "python benchmarks/spec_decode.py"

__all__ = [
    "PROMPT_LOOKUP",
    "REPEAT_AGAIN",
    "REPEAT_CUE_TOKENS",
    "REPEAT_INSTRUCTION",
    "BatchRow",
    "Engine",
    "EngineSpec",
    "Goal",
    "Series",
    "Settings",
    "SingleStreamRow",
    "StepCost",
    "StepProbe",
    "StepRecord",
    "Workload",
    "batch_rows",
    "bench_checkpoint",
    "engine_specs",
    "format_batch",
    "format_breakdown",
    "format_goals",
    "format_single_stream",
    "goals_for",
    "heldout_prompts",
    "heldout_text",
    "linear_weights",
    "main",
    "measure_linear_layers",
    "median_ratio",
    "plain_decode_steps",
    "random_prompts",
    "repeat_prompts",
    "rotated",
    "run_batch",
    "run_single_stream",
    "single_stream_rows",
    "start_engines",
    "step_breakdown",
    "verify_steps",
    "write_quick_checkpoint",
]


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
