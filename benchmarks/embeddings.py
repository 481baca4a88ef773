"""Embedding throughput (issue 43): kvflow's pooling runner against sentence-transformers on the same machine,
threads and inputs, in the same run; and `kvflow serve`'s /v1/embeddings against kvflow in-process.

Reproduce with `python benchmarks/embeddings.py` (`--model minilm` or `--model qwen3` for one model;
`--num-inputs N`; `--quick` is a seconds-long smoke run on tiny shapes). Checkpoints are made once and reused from
`.cache/embeddings-bench/` (`--cache-dir`).

Models (random weights, real shapes, saved in float32, written by `kvflow.testing.pooling_checkpoints`), run in
`--dtype`: "auto" (the default) leaves each side its own default, sentence-transformers the checkpoint's float32 and
kvflow's pooling runner its `dtype="auto"` (bfloat16 on a CPU with native bf16 arithmetic, AVX512_BF16 or AMX;
float32 on other CPUs); "float32" or "bfloat16" runs every contender in it (sentence-transformers loads the model in
it, kvflow's engines get it). The dtype each side ran is printed in the table:
- **minilm**: all-MiniLM-L6-v2's shape: `BertModel`, hidden 384, 6 layers, 12 heads, intermediate 1536, vocabulary
  30522, 512 positions; sentence-transformers mean pooling + normalize, `max_seq_length` 512 (the real model's is
  256; 512 here so that no input is cut).
- **qwen3**: Qwen3-Embedding-0.6B's shape: Qwen3, hidden 1024, 28 layers, 16 query / 8 KV heads of 128,
  intermediate 3072, vocabulary 151669; last-token pooling + normalize; kvflow's engines get `max_model_len` 2048
  and no prefix caching (kvflow caches a last-token-pooling decoder's prompts, and every round embeds the same
  texts: with the cache on, later rounds would compute nothing; sentence-transformers has no such cache).

Inputs: `--num-inputs` texts (default 1000 for minilm; 64 for qwen3, whose 0.6B parameters take minutes per
thousand inputs on a few cores) of random words from a built-in English text, each cut to a length drawn uniformly
from `--min-len`..`--max-len` tokens (16-512) with the model's tokenizer, special tokens included. Seeded.

Contenders, all alive for the whole run, timed on the whole input list per round:
1. **sentence-transformers**: `SentenceTransformer(path, device="cpu").encode(texts)` (its defaults: batches of
   32, sorted by length, padded).
2. **kvflow in-process**: `LLM(path, runner="pooling").embed(texts)`; its engine runs on a thread of this process,
   with as many torch threads as sentence-transformers (printed).
3. **kvflow serve**: `kvflow serve PATH --runner pooling` on 127.0.0.1 (its engine core uses every core, as
   in-process), one /v1/embeddings request per text, `--concurrency` (32) in flight, through `kvflow bench serve`'s
   aiohttp client (`--backend openai-embeddings`) in this process.
Each round runs the three in a rotated order (drift cancels), after a warm-up of each on the first 4 inputs; the
figure is inputs / median seconds. The embeddings of 1 and 2 (from their first timed runs) are checked against
each other (cosine per input, the minimum printed: under "auto", kvflow's default against sentence-transformers'
float32).

Goals (issue 43), printed with PASS / MISS: kvflow in-process >= 2.0x sentence-transformers; serve >= 0.8 of
in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

COMMAND = "python benchmarks/embeddings.py"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO / ".cache" / "embeddings-bench"
CHECKPOINT_MARKER = "kvflow-embeddings-benchmark.json"
CONTENDERS = ("sentence-transformers", "kvflow in-process", "kvflow serve")
SERVED_NAME = "embeddings-bench"
WARMUP_INPUTS = 4  # each contender's warm-up embeds the first inputs
GOALS = (("kvflow / sentence-transformers", 2.0), ("serve / in-process", 0.8))


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to make it (`maker` of `kvflow.testing.pooling_checkpoints` with `kwargs`), the
    engine settings both kvflow contenders get, and its default number of inputs."""

    maker: str
    kwargs: dict[str, Any]
    engine_args: dict[str, Any]
    default_num_inputs: int
    shape: str


MODELS: dict[str, ModelSpec] = {
    "minilm": ModelSpec(
        "make_tiny_encoder",
        {
            "kind": "bert",
            "vocab_size": 30522,
            "hidden_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 12,
            "intermediate_size": 1536,
            "max_position_embeddings": 512,
            "initializer_range": 0.02,
            "sentence_transformers": {"pooling": "mean", "normalize": True, "max_seq_length": 512},
        },
        {},
        1000,
        "all-MiniLM-L6-v2 (BERT, hidden 384, 6 layers, 12 heads, intermediate 1536, vocab 30522)",
    ),
    "qwen3": ModelSpec(
        "make_tiny_decoder_embedder",
        {
            "family": "qwen3",
            "vocab_size": 151669,
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 3072,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
            "sentence_transformers": {
                "pooling": "lasttoken",
                "normalize": True,
                "max_seq_length": 8192,
            },
        },
        {"max_model_len": 2048, "enable_prefix_caching": False},
        64,
        "Qwen3-Embedding-0.6B (Qwen3, hidden 1024, 28 layers, 16/8 heads of 128, intermediate 3072, "
        "vocab 151669)",
    ),
}
# --quick: the same kinds of model at tiny shapes.
QUICK_OVERRIDES: dict[str, dict[str, Any]] = {
    "minilm": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "sentence_transformers": {"pooling": "mean", "normalize": True, "max_seq_length": 128},
    },
    "qwen3": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
    },
}


@dataclass(frozen=True)
class Settings:
    num_inputs: int
    min_len: int
    max_len: int
    rounds: int
    concurrency: int


# ------------------------------------------------------------------------------------------------ inputs
def ensure_checkpoint(folder: Path, spec: ModelSpec, overrides: dict[str, Any]) -> Path:
    """The checkpoint `spec` describes (with `overrides`) in `folder`, made once and reused while the marker's
    description matches."""
    from kvflow.testing import pooling_checkpoints

    kwargs = {**spec.kwargs, **overrides}
    description = {"maker": spec.maker, "kwargs": kwargs, "seed": 0}
    marker = folder / CHECKPOINT_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == description:
        return folder
    _stderr(f"writing the {spec.maker} checkpoint to {folder} (once) ...")
    getattr(pooling_checkpoints, spec.maker)(folder, seed=0, **kwargs)
    marker.write_text(json.dumps(description))
    return folder


def make_inputs(
    model_path: Path, num_inputs: int, min_len: int, max_len: int, seed: int = 0
) -> tuple[list[str], list[int]]:
    """`num_inputs` texts of random corpus words and their lengths in tokens (with the special tokens the
    tokenizer adds): each is cut to a length drawn from [min_len, max_len] (a byte-level BPE may re-tokenize the
    cut text one token apart; the lengths returned are the texts' own)."""
    from kvflow.testing.pooling_checkpoints import corpus_words
    from kvflow.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    backend = tokenizer.backend
    num_special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))
    if min_len <= num_special or max_len < min_len:
        raise ValueError(f"need {num_special} < --min-len <= --max-len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    words = corpus_words()
    targets = [rng.randint(min_len, max_len) for _ in range(num_inputs)]
    drafts = [" ".join(rng.choice(words) for _ in range(target)) for target in targets]
    texts = []
    for draft, target, encoding in zip(
        drafts, targets, backend.encode_batch(drafts, add_special_tokens=False), strict=True
    ):
        keep = target - num_special
        texts.append(draft[: encoding.offsets[keep - 1][1]])
    lengths = [len(tokenizer.encode(text)) for text in texts]
    return texts, lengths


# ------------------------------------------------------------------------------------------------ contenders
def st_run(model: Any, texts: list[str]) -> Any:
    import torch

    return model.encode(texts, convert_to_tensor=True).to(torch.float32).numpy()


def kvflow_run(llm: Any, texts: list[str]) -> Any:
    import numpy as np

    outputs = llm.embed(texts, use_tqdm=False)
    return np.array([output.outputs.embedding for output in outputs], dtype=np.float32)


def serve_run(
    base_url: str, model_name: str, texts: list[str], lengths: list[int], concurrency: int
) -> None:
    from kvflow.benchmarks.datasets import SampleRequest
    from kvflow.benchmarks.serve import BenchmarkConfig, run_benchmark

    config = BenchmarkConfig(
        base_url=base_url,
        endpoint="/v1/embeddings",
        model=model_name,
        request_rate=float("inf"),
        max_concurrency=concurrency,
        seed=0,
    )
    samples = [SampleRequest(text, length, 1) for text, length in zip(texts, lengths, strict=True)]
    results, _ = asyncio.run(run_benchmark(config, samples))
    failed = [result.error for result in results if not result.success]
    if failed:
        raise RuntimeError(f"{len(failed)} embedding requests failed: {failed[:3]}")
    served = sum(result.prompt_len for result in results)
    if served != sum(lengths):
        raise RuntimeError(
            f"the server counted {served} input tokens, the inputs hold {sum(lengths)}"
        )


def _flag(key: str, value: Any) -> str:
    """The `kvflow serve` flag for an engine argument."""
    name = key.replace("_", "-")
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    return f"--{name}={value}"


def min_cosine(first: Any, second: Any) -> float:
    import numpy as np

    dots = (first * second).sum(axis=1)
    norms = np.linalg.norm(first, axis=1) * np.linalg.norm(second, axis=1)
    return float((dots / norms).min())


def measure(
    runs: dict[str, Callable[[slice], object]], rounds: int, num_inputs: int
) -> tuple[dict[str, float], dict[str, object]]:
    """Embeddings per second of each contender: inputs / median seconds over `rounds` rotated rounds of all the
    inputs, after a warm-up run of each on the first `WARMUP_INPUTS`; and what each one's first timed run returned.
    A run embeds the inputs its slice picks."""
    for name, run in runs.items():
        _stderr(f"  warm-up: {name} ...")
        run(slice(0, WARMUP_INPUTS))
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, object] = {}
    names = list(runs)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            output = runs[name](slice(None))
            seconds[name].append(time.perf_counter() - start)
            outputs.setdefault(name, output)
        _stderr(
            f"  round {round_index + 1}: "
            + ", ".join(f"{name} {num_inputs / times[-1]:.3g}/s" for name, times in seconds.items())
        )
    rates = {name: num_inputs / statistics.median(times) for name, times in seconds.items()}
    return rates, outputs


def bench_model(
    name: str,
    path: Path,
    settings: Settings,
    engine_args: dict[str, Any],
    with_server: bool,
    dtype: str = "auto",
) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    from benchmarks.serving import running_server
    from kvflow import LLM

    texts, lengths = make_inputs(path, settings.num_inputs, settings.min_len, settings.max_len)
    threads_before = torch.get_num_threads()
    st_kwargs = {} if dtype == "auto" else {"model_kwargs": {"dtype": getattr(torch, dtype)}}
    st_model = SentenceTransformer(str(path), device="cpu", **st_kwargs)
    engine_args = {**engine_args, "dtype": dtype}
    llm = LLM(str(path), runner="pooling", disable_log_stats=True, **engine_args)
    # What each side runs in; `kvflow serve` gets the same engine arguments on the same CPU, so the same dtype.
    kvflow_dtype = _dtype_name(llm.collective_rpc(_worker_model_dtype)[0])
    dtypes = {
        CONTENDERS[0]: _dtype_name(next(st_model.parameters()).dtype),
        CONTENDERS[1]: kvflow_dtype,
        CONTENDERS[2]: kvflow_dtype,
    }
    threads = torch.get_num_threads()
    if threads != threads_before:
        raise RuntimeError(
            f"LLM changed this process's torch threads: {threads_before} -> {threads}"
        )
    runs: dict[str, Callable[[slice], object]] = {
        CONTENDERS[0]: lambda part: st_run(st_model, texts[part]),
        CONTENDERS[1]: lambda part: kvflow_run(llm, texts[part]),
    }
    serve_args = [_flag(key, value) for key, value in engine_args.items()]
    if with_server:
        engine = ["--runner", "pooling", "--served-model-name", SERVED_NAME, *serve_args]
        with running_server([str(path)], engine) as (base_url, _):
            runs[CONTENDERS[2]] = lambda part: serve_run(
                base_url, SERVED_NAME, texts[part], lengths[part], settings.concurrency
            )
            rates, outputs = measure(runs, settings.rounds, len(texts))
    else:
        rates, outputs = measure(runs, settings.rounds, len(texts))
    cosine = min_cosine(outputs[CONTENDERS[0]], outputs[CONTENDERS[1]])
    return {
        "model": name,
        "num_inputs": len(texts),
        "input_tokens": sum(lengths),
        "min_len": min(lengths),
        "max_len": max(lengths),
        "torch_threads": threads,
        "embeddings_per_s": rates,
        "min_cosine": cosine,
        "dtypes": {name: dtypes[name] for name in rates},
    }


def _worker_model_dtype(worker: Any) -> Any:
    """On kvflow's worker: the dtype its model's weights are held in."""
    return next(worker.model.parameters()).dtype


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------ report
def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report_table(
    results: list[dict[str, Any]],
) -> tuple[str, list[tuple[str, float | None, float]]]:
    """The markdown tables RESULTS.md records and the goals (name, measured, target)."""
    lines = [
        "| model | inputs | tokens | "
        + " | ".join(f"{name} emb/s" for name in CONTENDERS)
        + " | kvflow / ST | serve / in-process | min cosine | dtype ST / kvflow |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    goals: list[tuple[str, float | None, float]] = []
    for result in results:
        rates = result["embeddings_per_s"]
        speedup = _ratio(rates[CONTENDERS[1]], rates[CONTENDERS[0]])
        serve_ratio = _ratio(rates.get(CONTENDERS[2]), rates[CONTENDERS[1]])
        lines.append(
            f"| {result['model']} | {result['num_inputs']} | {result['input_tokens']} | "
            + " | ".join(_cell(rates.get(name)) for name in CONTENDERS)
            + f" | {_cell(speedup)} | {_cell(serve_ratio)} | {result['min_cosine']:.7f} | "
            f"{result['dtypes'][CONTENDERS[0]]} / {result['dtypes'][CONTENDERS[1]]} |"
        )
        goals += [
            (f"{result['model']}: {GOALS[0][0]}", speedup, GOALS[0][1]),
            (f"{result['model']}: {GOALS[1][0]}", serve_ratio, GOALS[1][1]),
        ]
    lines += ["", "| goal | measured | target | |", "|---|---|---|---|"]
    for name, value, target in goals:
        verdict = "SKIP" if value is None else ("PASS" if value >= target else "MISS")
        lines.append(f"| {name} | {_cell(value)} | >= {target} | {verdict} |")
    return "\n".join(lines), goals


def cpu_description() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return name


# ------------------------------------------------------------------------------------------------ main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and inputs: a smoke run")
    parser.add_argument("--model", choices=(*MODELS, "all"), default="all")
    parser.add_argument(
        "--num-inputs", type=int, default=None, help="default: 1000 (minilm), 64 (qwen3); quick 16"
    )
    parser.add_argument("--min-len", type=int, default=None, help="default 16")
    parser.add_argument("--max-len", type=int, default=None, help="default 512 (quick: 64)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--concurrency", type=int, default=32, help="server requests in flight")
    parser.add_argument("--no-server", action="store_true", help="skip the kvflow serve contender")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="every contender's dtype (the checkpoints are float32); auto: each side's default "
        "(sentence-transformers float32, kvflow's pooling runner bfloat16 on a CPU with native bf16)",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace, spec: ModelSpec) -> Settings:
    return Settings(
        num_inputs=args.num_inputs or (16 if args.quick else spec.default_num_inputs),
        min_len=args.min_len or 16,
        max_len=args.max_len or (64 if args.quick else 512),
        rounds=args.rounds or (1 if args.quick else 3),
        concurrency=args.concurrency,
    )


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    import torch

    names = list(MODELS) if args.model == "all" else [args.model]
    argv_shown = argv if argv is not None else sys.argv[1:]
    print(f"# {COMMAND} {shlex.join(argv_shown)}")
    print(
        f"# {cpu_description()}; {os.cpu_count()} CPUs; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = []
    for name in names:
        spec = MODELS[name]
        settings = _settings(args, spec)
        overrides = QUICK_OVERRIDES[name] if args.quick else {}
        folder = args.cache_dir / (f"{name}-quick" if args.quick else name)
        path = ensure_checkpoint(folder, spec, overrides)
        shape = "tiny shapes (--quick)" if args.quick else spec.shape
        note = (
            f" (fewer than minilm's {MODELS['minilm'].default_num_inputs}: a 0.6B model takes minutes per "
            "thousand inputs on a few cores; --num-inputs sets it)"
            if name == "qwen3" and args.num_inputs is None and not args.quick
            else ""
        )
        print(
            f"# {name}: {shape}, {args.dtype}; {settings.num_inputs} inputs{note} of {settings.min_len}-"
            f"{settings.max_len} tokens; {settings.rounds} rounds; server concurrency {settings.concurrency}",
            flush=True,
        )
        _stderr(f"{name}: measuring ...")
        result = bench_model(name, path, settings, spec.engine_args, not args.no_server, args.dtype)
        result["dtype"] = args.dtype
        result["settings"] = asdict(settings)
        results.append(result)
    table, goals = report_table(results)
    print(table, flush=True)
    summary = {
        "command": f"{COMMAND} {shlex.join(argv_shown)}",
        "cpu": cpu_description(),
        "results": results,
        "goals": [{"goal": n, "measured": v, "target": t} for n, v, t in goals],
    }
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
