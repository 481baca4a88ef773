"""Multi-LoRA serving (issue 42): a batch spread over 8 PEFT adapters against the same batch without adapters,
single-stream decode with and without an adapter, and the cost of loading and activating an adapter, same run.

Reproduce with `python benchmarks/lora.py` (`--dtype bfloat16` for the model in bfloat16; `--quick` is a
seconds-long smoke run). The adapters are made once and reused from `.cache/lora-bench/` (`--cache-dir`).

Model: kvflow's built-in default model (a 6-layer Llama, hidden 384, intermediate 1024, 6 query / 2 KV heads,
vocabulary 4096) in float32 (its checkpoint's dtype) unless `--dtype` says otherwise. Adapters: `--num-adapters` (8)
rank-`--rank` (16) LoRA adapters made and saved by PEFT (`peft.get_peft_model` + `save_pretrained`, lora_alpha
2 x rank) on that checkpoint, targeting all seven linear modules (q/k/v/o/gate/up/down), every lora_A and lora_B
random (normal, std `INIT_STD`, seeded per adapter; PEFT would start B at zero, a no-op adapter).

Engines, both alive for the whole run: **LoRA off**, `LLM(model, dtype)`; **LoRA on**, the same with
`enable_lora=True`, `max_loras` = the number of adapters (8), `max_lora_rank` = `--rank` (16), `max_cpu_loras` twice
`max_loras`. `max_num_seqs` 64 on both.

Figures (output tokens / wall seconds; every run starts from an empty prefix cache):
1. **batch**: `--num-requests` (64) requests, random token prompts of 64-128 tokens, 64-128 output tokens each
   (`ignore_eos`, greedy; fixed by seed 0), generated at once in four ways: base on LoRA off; base on LoRA on
   (enabled, unused); spread round-robin over the 8 adapters; mixed (even requests base, odd ones round-robin over
   the adapters). `--rounds` (5) rounds, the order of the four reversed every other round to cancel drift; median.
   The adapters are loaded and in slots before the first timed run (an untimed warm-up runs every case).
2. **single stream**: one request at a time (a 32-token prompt, `--output-len` 256 greedy tokens), decode tokens/s
   from the request's metrics (first to last token), base on LoRA off, base on LoRA on, and with an adapter;
   interleaved (order reversed every other round), `--rounds` each after a warm-up round, median.
3. **adapter load**: `llm.add_lora` of an adapter the engine has not loaded (a new id on one of the adapter
   folders: read from disk and packed into kvflow's layers, not put in a slot), ms, median of `--load-repeats`;
   **activation**: a one-token request (16-token prompt) with that just-loaded adapter, whose first step writes it
   into a slot, minus the same request again once it sits in a slot, ms, median.

Goals (issue 42), printed with PASS / MISS: batch spread over 8 adapters >= 0.8 of base, single-stream decode with
an adapter >= 0.9 of base; base is the LoRA-off engine (the stricter; the LoRA-on-unused ratios are printed too).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

COMMAND = "python benchmarks/lora.py"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO / ".cache" / "lora-bench"
ADAPTERS_MARKER = "kvflow-lora-benchmark.json"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Per-entry std of the random lora_A / lora_B: large enough that an adapter changes greedy tokens (the figures do
# not depend on it; `ignore_eos` fixes every output length).
INIT_STD = 0.05
NUM_SPECIAL_TOKENS = 4  # the default model's last ids are special tokens; prompts stay below them
BATCH_CASES = ("base, LoRA off", "base, LoRA on", "adapters round-robin", "mixed: half base")
STREAM_CASES = ("base, LoRA off", "base, LoRA on", "adapter")


@dataclass(frozen=True)
class Settings:
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    stream_prompt_len: int
    stream_output_len: int
    rounds: int
    load_repeats: int


FULL = Settings(64, (64, 128), (64, 128), 32, 256, 5, 8)
QUICK = Settings(8, (8, 16), (4, 8), 8, 8, 1, 2)


# ------------------------------------------------------------------------------------------------ adapters
def ensure_adapters(
    base: Path, folder: Path, num_adapters: int, rank: int, seed: int = 0
) -> list[Path]:
    """`num_adapters` PEFT adapters of rank `rank` (lora_alpha 2 x rank) on `base`, made by PEFT once and reused
    while the marker's description matches: `folder/adapter-<i>`, each with lora_A / lora_B from a generator
    seeded with `seed + i`."""
    import peft
    import torch

    from kvflow.testing.hf_checkpoints import load_hf_model

    description = {
        "base": str(base),
        "base_config": json.loads((base / "config.json").read_text()),
        "num_adapters": num_adapters,
        "rank": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGET_MODULES),
        "init_std": INIT_STD,
        "seed": seed,
    }
    paths = [folder / f"adapter-{index}" for index in range(num_adapters)]
    marker = folder / ADAPTERS_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == description:
        return paths
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES), lora_dropout=0.0
    )
    state = torch.random.get_rng_state()
    try:  # peft initialises lora_A from the global RNG
        model = peft.get_peft_model(load_hf_model(base), config)
    finally:
        torch.random.set_rng_state(state)
    folder.mkdir(parents=True, exist_ok=True)
    for index, path in enumerate(paths):
        generator = torch.Generator().manual_seed(seed + index)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
        model.save_pretrained(path)
    marker.write_text(json.dumps(description))
    return paths


# ------------------------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(settings: Settings, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(*settings.prompt_range))]
        for _ in range(settings.num_requests)
    ]
    return Workload(prompts, [rng.randint(*settings.output_range) for _ in prompts])


def batch_adapters(case: str, num_requests: int, loras: Sequence[Any]) -> list[Any] | None:
    """Each request's LoRARequest (None: base) for a batch case."""
    if case.startswith("base"):
        return None
    if case == BATCH_CASES[2]:
        return [loras[index % len(loras)] for index in range(num_requests)]
    return [
        None if index % 2 == 0 else loras[(index // 2) % len(loras)]
        for index in range(num_requests)
    ]


def run_batch(llm: Any, workload: Workload, lora_requests: list[Any] | None) -> float:
    """Seconds to generate the whole workload at once (prefix cache emptied first)."""
    from kvflow import SamplingParams

    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.output_lens
    ]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in workload.prompts],
        params,
        use_tqdm=False,
        lora_request=lora_requests,
    )
    elapsed = time.perf_counter() - start
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    return elapsed


def decode_tokens_per_s(llm: Any, prompt: list[int], output_len: int, lora_request: Any) -> float:
    """Decode tokens/s of one request alone: (tokens - 1) / (last token time - first token time)."""
    from kvflow import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    (output,) = llm.generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora_request
    )
    metrics = output.metrics
    num_tokens = len(output.outputs[0].token_ids)
    assert num_tokens == output_len, (num_tokens, output_len)
    assert metrics is not None and metrics.first_token_time and metrics.last_token_time
    return (num_tokens - 1) / (metrics.last_token_time - metrics.first_token_time)


def one_token_ms(llm: Any, prompt: list[int], lora_request: Any) -> float:
    from kvflow import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora_request)
    return 1000.0 * (time.perf_counter() - start)


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return 1000.0 * (time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ report
def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report_table(
    batch: dict[str, float], stream: dict[str, float], load: dict[str, float]
) -> tuple[str, list[tuple[str, float | None, float]]]:
    """The markdown table RESULTS.md records and the goals (name, measured, target)."""
    base_off, base_on = batch[BATCH_CASES[0]], batch[BATCH_CASES[1]]
    lines = [
        "| batch case | output tok/s | / base LoRA off | / base LoRA on |",
        "|---|---|---|---|",
    ]
    for case in BATCH_CASES:
        lines.append(
            f"| {case} | {batch[case]:.1f} | {_cell(_ratio(batch[case], base_off))} "
            f"| {_cell(_ratio(batch[case], base_on))} |"
        )
    stream_off, stream_on = stream[STREAM_CASES[0]], stream[STREAM_CASES[1]]
    lines += [
        "",
        "| single stream | decode tok/s | / base LoRA off | / base LoRA on |",
        "|---|---|---|---|",
    ]
    for case in STREAM_CASES:
        lines.append(
            f"| {case} | {stream[case]:.1f} | {_cell(_ratio(stream[case], stream_off))} "
            f"| {_cell(_ratio(stream[case], stream_on))} |"
        )
    lines += [
        "",
        "| adapter | ms (median) |",
        "|---|---|",
        f"| load (`add_lora`, not cached) | {load['load_ms']:.1f} |",
        f"| activation (first step into a slot) | {load['activation_ms']:.1f} |",
    ]
    goals: list[tuple[str, float | None, float]] = [
        ("batch: adapters / base (LoRA off)", _ratio(batch[BATCH_CASES[2]], base_off), 0.8),
        ("single stream: adapter / base (LoRA off)", _ratio(stream["adapter"], stream_off), 0.9),
    ]
    lines += ["", "| goal | measured | target | |", "|---|---|---|---|"]
    for name, value, target in goals:
        verdict = "SKIP" if value is None else ("PASS" if value >= target else "MISS")
        lines.append(f"| {name} | {_cell(value)} | >= {target} | {verdict} |")
    return "\n".join(lines), goals


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's model name and which of its flags matter here (avx512*, amx*)."""
    name, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags":
            flags = sorted(
                flag for flag in value.split() if flag.startswith(("avx512", "amx", "avx2"))
            )
            break
    return name, flags


# ------------------------------------------------------------------------------------------------ main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny workload: a smoke run")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=None, help="default 64 (quick: 8)")
    parser.add_argument("--output-len", type=int, default=None, help="single stream; default 256")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (quick: 1)")
    parser.add_argument("--load-repeats", type=int, default=None, help="default 8 (quick: 2)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace) -> Settings:
    settings = QUICK if args.quick else FULL
    return Settings(
        num_requests=args.num_requests or settings.num_requests,
        prompt_range=settings.prompt_range,
        output_range=settings.output_range,
        stream_prompt_len=settings.stream_prompt_len,
        stream_output_len=args.output_len or settings.stream_output_len,
        rounds=args.rounds or settings.rounds,
        load_repeats=args.load_repeats or settings.load_repeats,
    )


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    import torch

    from kvflow import LLM, LoRARequest
    from kvflow.default_model import ensure_default_model

    settings = _settings(args)
    argv_shown = argv if argv is not None else sys.argv[1:]
    cpu_name, cpu_flags = cpu_description()
    base = ensure_default_model()
    vocab_size = json.loads((base / "config.json").read_text())["vocab_size"]
    prompt_vocab = vocab_size - NUM_SPECIAL_TOKENS
    adapter_dir = args.cache_dir / f"default-model-r{args.rank}"
    _stderr(f"adapters: {args.num_adapters} x rank {args.rank} in {adapter_dir} ...")
    paths = ensure_adapters(base, adapter_dir, args.num_adapters, args.rank)
    loras = [
        LoRARequest(f"bench-{index}", index + 1, str(path)) for index, path in enumerate(paths)
    ]
    workload = make_workload(settings, prompt_vocab)
    max_model_len = max(
        max(map(len, workload.prompts)) + max(workload.output_lens),
        settings.stream_prompt_len + settings.stream_output_len,
    )
    max_model_len = 16 * -(-(max_model_len + 16) // 16)
    common = {
        "dtype": args.dtype,
        "max_num_seqs": 64,
        "max_model_len": max_model_len,
        "skip_tokenizer_init": True,
        "disable_log_stats": True,
    }
    print(f"# {COMMAND} {shlex.join(argv_shown)}")
    print(
        f"# {cpu_name}; {os.cpu_count()} CPUs; flags: {' '.join(cpu_flags)}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"# default model ({base.name}), {args.dtype}; {len(loras)} PEFT adapters of rank {args.rank} on "
        f"{', '.join(TARGET_MODULES)}; batch: {settings.num_requests} requests, prompt tokens "
        f"{sum(map(len, workload.prompts))}, output tokens {workload.num_output_tokens}; single stream: "
        f"{settings.stream_prompt_len}-token prompt, {settings.stream_output_len} tokens",
        flush=True,
    )
    engines = {
        "off": LLM(str(base), **common),
        "on": LLM(
            str(base),
            enable_lora=True,
            max_loras=len(loras),
            max_lora_rank=args.rank,
            max_cpu_loras=2 * len(loras),
            **common,
        ),
    }
    try:
        batch_runs: dict[str, Callable[[], float]] = {}
        for case in BATCH_CASES:
            llm = engines["off" if case == BATCH_CASES[0] else "on"]
            adapters = batch_adapters(case, len(workload.prompts), loras)
            batch_runs[case] = lambda llm=llm, adapters=adapters: run_batch(llm, workload, adapters)
        _stderr("batch: warm-up ...")
        for run in batch_runs.values():
            run()
        batch_s: dict[str, list[float]] = {case: [] for case in BATCH_CASES}
        for round_index in range(settings.rounds):
            order = BATCH_CASES if round_index % 2 == 0 else BATCH_CASES[::-1]
            for case in order:
                batch_s[case].append(batch_runs[case]())
            _stderr(
                f"batch round {round_index + 1}: "
                + ", ".join(
                    f"{case} {workload.num_output_tokens / batch_s[case][-1]:.1f} tok/s"
                    for case in BATCH_CASES
                )
            )
        batch = {
            case: workload.num_output_tokens / statistics.median(times)
            for case, times in batch_s.items()
        }

        rng = random.Random(1)
        stream_runs = {
            STREAM_CASES[0]: (engines["off"], None),
            STREAM_CASES[1]: (engines["on"], None),
            STREAM_CASES[2]: (engines["on"], loras[0]),
        }
        stream_samples: dict[str, list[float]] = {case: [] for case in STREAM_CASES}
        for round_index in range(settings.rounds + 1):  # the first round is a warm-up
            prompt = [rng.randrange(prompt_vocab) for _ in range(settings.stream_prompt_len)]
            order = STREAM_CASES if round_index % 2 == 0 else STREAM_CASES[::-1]
            for case in order:
                llm, lora_request = stream_runs[case]
                rate = decode_tokens_per_s(llm, prompt, settings.stream_output_len, lora_request)
                if round_index:
                    stream_samples[case].append(rate)
            if round_index:
                _stderr(
                    f"single stream round {round_index}: "
                    + ", ".join(f"{c} {s[-1]:.1f} tok/s" for c, s in stream_samples.items())
                )
        stream = {case: statistics.median(rates) for case, rates in stream_samples.items()}

        llm = engines["on"]
        load_ms, activation_ms = [], []
        short = [rng.randrange(prompt_vocab) for _ in range(16)]
        one_token_ms(llm, short, loras[0])  # warm-up
        for repeat in range(settings.load_repeats):
            fresh = LoRARequest(
                f"fresh-{repeat}", 1000 + repeat, loras[repeat % len(loras)].lora_path
            )
            load_ms.append(timed_ms(lambda fresh=fresh: llm.add_lora(fresh)))
            first = one_token_ms(llm, short, fresh)
            again = one_token_ms(llm, short, fresh)
            activation_ms.append(first - again)
        load = {
            "load_ms": statistics.median(load_ms),
            "activation_ms": statistics.median(activation_ms),
        }
        _stderr(
            f"adapter load ms: {[round(ms, 1) for ms in load_ms]}; "
            f"activation ms: {[round(ms, 1) for ms in activation_ms]}"
        )
    finally:
        for engine in engines.values():
            engine.shutdown()

    table, goals = report_table(batch, stream, load)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    print()
    print(table)
    results: dict[str, Any] = {
        "command": f"{COMMAND} {shlex.join(argv_shown)}",
        "cpu": cpu_name,
        "cpu_flags": cpu_flags,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "num_adapters": len(loras),
        "rank": args.rank,
        "batch_tokens_per_s": batch,
        "batch_seconds": batch_s,
        "single_stream_tokens_per_s": stream,
        "single_stream_samples": stream_samples,
        "load_ms": load_ms,
        "activation_ms": activation_ms,
        "load": load,
        "goals": [
            {"goal": name, "measured": value, "target": target} for name, value, target in goals
        ],
        "table": table,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
