"""Mixture-of-experts decode: kvflow on a Qwen3-MoE-shaped GGUF Q4_K_M file against llama.cpp on the same file,
and against a dense model with the same active parameters, same run.

Reproduce with `python benchmarks/moe.py` (the first run makes the checkpoints and converts them: ~15 minutes on
2 cores; later runs reuse `.cache/moe-bench/`); `--quick` is a one-minute smoke run on a tiny shape.
llama.cpp's tools come from `tools/build_llama_cpp.sh llama-bench llama-server` (`--llama-cpp-bin` for another
folder, `--skip-llama-cpp` for the kvflow side alone).

Checkpoints (random bf16 weights, init std 0.02, written tensor by tensor with a synthetic byte-level tokenizer of
the vocabulary's size): **moe**, Qwen3-MoE-shaped (`Qwen3MoeForCausalLM`: hidden 2048, 16 layers, 32 query / 4 KV
heads of 128, q/k norms, 32 experts of intermediate 768, top-8 renormalised, vocab 151936, untied head: 3.35 B
parameters, 1.53 B active per token counting the token embedding, of which a token reads one row: 1.22 B
without it); **dense**, the same with a dense SwiGLU of intermediate 8 x 768 = 6144 in
every layer (`Qwen3ForCausalLM`: the same active parameters). Both are converted by the project's converter
(`tools/convert_to_gguf.py --outtype Q4_K_M`) and everything below runs on those files.

Figures, one after the other in this process (only ratios within one run compare):
1. **single stream** (per model): kvflow `LLM(model=FILE.gguf, tokenizer=FOLDER, max_num_seqs=1)`, one request at a
   time, a 32-token random prompt, `--output-len` greedy tokens with `ignore_eos`, decode time only (first to last
   token from the request's metrics, `latency.measure_decode`; median of `--repeat`), against `llama-bench -p 0 -n
   OUTPUT_LEN -t THREADS` (tg).
2. **batch-16** (moe): 16 concurrent /v1/completions requests (prompts 32-128 tokens, outputs 64-128, greedy,
   `ignore_eos`) to `kvflow serve FILE.gguf --tokenizer FOLDER --max-num-seqs 16` and to `llama-server -np 16`
   (/completion, `n_predict`): output tokens / wall seconds.
The table at the end holds the issue-41 goals: kvflow / llama.cpp single stream >= 1.0 and batch-16 >= 1.5, and
kvflow moe / kvflow dense single stream >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.quantized_checkpoint import (
    CONVERTER,
    DEFAULT_LLAMA_CPP_BIN,
    NUM_SPECIAL_TOKENS,
    cpu_description,
    run_logged,
    synthetic_tokenizer,
)
from benchmarks.quantized_report import _cell, _ratio
from benchmarks.quantized_runs import (
    BatchedResult,
    bench_kvflow_serve,
    bench_llama_server,
    run_llama_bench,
)

COMMAND = "python benchmarks/moe.py"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = REPO / ".cache" / "moe-bench"
CHECKPOINT_MARKER = "kvflow-moe-benchmark.json"
INIT_STD = 0.02
OUTTYPE = "Q4_K_M"


@dataclass(frozen=True)
class MoeShape:
    """A Qwen3-MoE shape; `dense_config` is the dense model with the same active parameters per token."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    vocab_size: int

    def common_config(self) -> dict[str, Any]:
        num_bpe = self.vocab_size - NUM_SPECIAL_TOKENS
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "bos_token_id": num_bpe,
            "eos_token_id": num_bpe + 1,
            "torch_dtype": "bfloat16",
        }

    def moe_config(self) -> dict[str, Any]:
        return {
            **self.common_config(),
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "intermediate_size": self.moe_intermediate_size * self.num_experts_per_tok,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }

    def dense_config(self) -> dict[str, Any]:
        return {
            **self.common_config(),
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": self.moe_intermediate_size * self.num_experts_per_tok,
        }

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters of the MoE model, the token embedding counted once in both."""
        hidden, head_dim = self.hidden_size, self.head_dim
        attention = (
            hidden * head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        )
        expert = 3 * hidden * self.moe_intermediate_size
        router = self.num_experts * hidden
        layers = self.num_hidden_layers
        embeddings = 2 * self.vocab_size * hidden
        total = layers * (attention + router + self.num_experts * expert) + embeddings
        active = layers * (attention + router + self.num_experts_per_tok * expert) + embeddings
        return total, active


QWEN3_MOE_SHAPE = MoeShape(2048, 16, 32, 4, 128, 32, 8, 768, 151936)
QUICK_SHAPE = MoeShape(256, 2, 4, 2, 64, 8, 2, 256, 1024)


# ------------------------------------------------------------------------------------------------ checkpoints
def _layer_tensors(config: dict[str, Any], layer: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of decoder layer `layer` in a Qwen3 / Qwen3-MoE checkpoint."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    prefix = f"model.layers.{layer}."
    yield prefix + "input_layernorm.weight", (hidden,)
    yield prefix + "post_attention_layernorm.weight", (hidden,)
    yield prefix + "self_attn.q_proj.weight", (config["num_attention_heads"] * head_dim, hidden)
    yield prefix + "self_attn.k_proj.weight", (config["num_key_value_heads"] * head_dim, hidden)
    yield prefix + "self_attn.v_proj.weight", (config["num_key_value_heads"] * head_dim, hidden)
    yield prefix + "self_attn.o_proj.weight", (hidden, config["num_attention_heads"] * head_dim)
    yield prefix + "self_attn.q_norm.weight", (head_dim,)
    yield prefix + "self_attn.k_norm.weight", (head_dim,)
    if config["model_type"] == "qwen3_moe":
        inner = config["moe_intermediate_size"]
        yield prefix + "mlp.gate.weight", (config["num_experts"], hidden)
        for expert in range(config["num_experts"]):
            expert_prefix = f"{prefix}mlp.experts.{expert}."
            yield expert_prefix + "gate_proj.weight", (inner, hidden)
            yield expert_prefix + "up_proj.weight", (inner, hidden)
            yield expert_prefix + "down_proj.weight", (hidden, inner)
    else:
        inner = config["intermediate_size"]
        yield prefix + "mlp.gate_proj.weight", (inner, hidden)
        yield prefix + "mlp.up_proj.weight", (inner, hidden)
        yield prefix + "mlp.down_proj.weight", (hidden, inner)


def _random_tensor(name: str, shape: tuple[int, ...], generator: Any) -> Any:
    import torch

    if name.endswith("norm.weight"):  # around 1, as trained norms are
        values = 1.0 + 0.1 * torch.randn(shape, generator=generator)
    else:
        values = INIT_STD * torch.randn(shape, generator=generator)
    return values.to(torch.bfloat16)


def write_random_checkpoint(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random-weight bf16 checkpoint of `config`, one safetensors shard per decoder layer (plus one for the
    embeddings, final norm and head), an index, and the synthetic tokenizer; made once, reused while the
    marker's config matches."""
    import torch
    from safetensors.torch import save_file

    marker = folder / CHECKPOINT_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == config:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [
        [
            ("model.embed_tokens.weight", (config["vocab_size"], hidden)),
            ("model.norm.weight", (hidden,)),
            ("lm_head.weight", (config["vocab_size"], hidden)),
        ]
    ]
    shards += [list(_layer_tensors(config, layer)) for layer in range(config["num_hidden_layers"])]
    weight_map: dict[str, str] = {}
    for index, tensors in enumerate(shards):
        shard_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {name: _random_tensor(name, shape, generator) for name, shape in tensors},
            str(folder / shard_name),
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys((name for name, _ in tensors), shard_name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(json.dumps(synthetic_tokenizer(config["vocab_size"])))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "add_bos_token": False,
                "model_max_length": config["max_position_embeddings"],
            }
        )
    )
    marker.write_text(json.dumps(config))
    return folder


def ensure_gguf(checkpoint: Path, out: Path) -> Path:
    """`tools/convert_to_gguf.py CHECKPOINT OUT --outtype Q4_K_M`, once per checkpoint (a stamp file says which)."""
    stamp = out.with_suffix(".source.json")
    source = (checkpoint / CHECKPOINT_MARKER).read_text()
    if out.is_file() and stamp.is_file() and stamp.read_text() == source:
        return out
    partial = out.with_suffix(".partial")
    command = [sys.executable, str(CONVERTER), str(checkpoint), str(partial), "--outtype", OUTTYPE]
    run_logged(command, f"converting {checkpoint.name} to {OUTTYPE}")
    partial.rename(out)
    stamp.write_text(source)
    return out


# ------------------------------------------------------------------------------------------------ runs
@dataclass
class ModelRun:
    """One model's single-stream figures: kvflow's ms per decode token and llama-bench's tokens/s."""

    name: str
    gguf: Path
    kvflow_ms_per_token: list[float] = field(default_factory=list)
    llama_decode_tokens_per_s: float | None = None
    llama_command: str = ""
    weight_bytes: int = 0
    error: str = ""

    @property
    def kvflow_tokens_per_s(self) -> float | None:
        if not self.kvflow_ms_per_token:
            return None
        return 1000.0 / statistics.median(self.kvflow_ms_per_token)


def kvflow_single_stream(
    gguf: Path, tokenizer: Path, vocab_size: int, prompt_len: int, output_len: int, repeat: int
) -> tuple[list[float], int]:
    """ms per decode token of one request at a time (`latency.measure_decode`) and the resident weight bytes."""
    from benchmarks import latency
    from benchmarks.quantized_runs import resident_weight_bytes
    from kvflow import LLM

    max_model_len = prompt_len + output_len + 16
    llm = LLM(
        model=str(gguf),
        tokenizer=str(tokenizer),
        max_model_len=max_model_len,
        num_kv_blocks=2 * -(-max_model_len // 16),
        max_num_seqs=1,
        disable_log_stats=True,
    )
    try:
        result = latency.measure_decode(llm, vocab_size, prompt_len, output_len, repeat)
        (weights,) = llm.collective_rpc(resident_weight_bytes)
    finally:
        llm.shutdown()
    return result.ms_per_token, weights


@dataclass(frozen=True)
class BatchWorkload:
    """`throughput.Workload`'s fields: prompts (token ids) and output lengths."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def batch_workload(num_requests: int, vocab_size: int, quick: bool) -> BatchWorkload:
    from benchmarks import throughput

    prompt_range, output_range = ((8, 32), (8, 16)) if quick else ((32, 128), (64, 128))
    workload = throughput.make_workload(
        num_requests, prompt_range, output_range, vocab_size - NUM_SPECIAL_TOKENS, seed=0
    )
    return BatchWorkload(workload.prompts, workload.output_lens)


# ------------------------------------------------------------------------------------------------ report
def goals_table(runs: dict[str, ModelRun], batched: dict[str, BatchedResult]) -> str:
    """The markdown table RESULTS.md records: the figures, then each goal as a ratio with PASS / MISS."""
    lines = [
        "| model | kvflow tok/s | llama.cpp tok/s | kvflow / llama.cpp |",
        "|---|---|---|---|",
    ]
    for run in runs.values():
        ours, theirs = run.kvflow_tokens_per_s, run.llama_decode_tokens_per_s
        lines.append(
            f"| {run.name} single stream | {_cell(ours)} | {_cell(theirs)} | {_cell(_ratio(ours, theirs))} |"
        )
    kv_batch = batched.get("kvflow")
    ll_batch = batched.get("llama.cpp")
    kv_rate = kv_batch.output_tokens_per_s if kv_batch else None
    ll_rate = ll_batch.output_tokens_per_s if ll_batch else None
    lines.append(
        f"| moe batch-16 | {_cell(kv_rate)} | {_cell(ll_rate)} | {_cell(_ratio(kv_rate, ll_rate))} |"
    )
    moe, dense = runs.get("moe"), runs.get("dense")
    goals = [
        (
            "single stream: kvflow / llama.cpp",
            _ratio(moe and moe.kvflow_tokens_per_s, moe and moe.llama_decode_tokens_per_s),
            1.0,
        ),
        ("batch-16: kvflow / llama.cpp", _ratio(kv_rate, ll_rate), 1.5),
        (
            "kvflow moe / kvflow dense (same active params)",
            _ratio(moe and moe.kvflow_tokens_per_s, dense and dense.kvflow_tokens_per_s),
            0.8,
        ),
    ]
    lines += ["", "| goal | measured | target | |", "|---|---|---|---|"]
    for name, value, target in goals:
        verdict = "SKIP" if value is None else ("PASS" if value >= target else "MISS")
        lines.append(f"| {name} | {_cell(value)} | >= {target} | {verdict} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class SingleStreamSettings:
    """What a single-stream measurement uses: sizes, repeats, llama-bench's threads."""

    vocab_size: int
    prompt_len: int
    output_len: int
    repeat: int
    threads: int


def single_stream(
    name: str,
    config: dict[str, Any],
    cache: Path,
    settings: SingleStreamSettings,
    bench: Path | None,
    errors: list[str],
) -> ModelRun | None:
    """Make (or reuse) `name`'s checkpoint and Q4_K_M file, then measure kvflow's and llama-bench's decode on it;
    None when the files could not be made (the error is in `errors`)."""
    checkpoint = _attempt(
        f"{name}: checkpoint", lambda: write_random_checkpoint(cache / name, config), errors
    )
    if checkpoint is None:
        return None
    gguf = _attempt(
        f"{name}: {OUTTYPE} file",
        lambda: ensure_gguf(checkpoint, cache / f"{name}-{OUTTYPE}.gguf"),
        errors,
    )
    if gguf is None:
        return None
    run = ModelRun(name, gguf)
    measured = _attempt(
        f"{name}: kvflow single stream",
        lambda: kvflow_single_stream(
            gguf,
            checkpoint,
            settings.vocab_size,
            settings.prompt_len,
            settings.output_len,
            settings.repeat,
        ),
        errors,
    )
    if measured is not None:
        run.kvflow_ms_per_token, run.weight_bytes = measured
    if bench is not None:
        result = _attempt(
            f"{name}: llama-bench",
            lambda: run_llama_bench(
                bench, gguf, settings.threads, settings.output_len, 0, settings.repeat
            ),
            errors,
        )
        if result is not None:
            run.llama_decode_tokens_per_s = result.decode_tokens_per_s
            run.llama_command = result.command
    print(
        f"{name:<6} single stream: kvflow {_cell(run.kvflow_tokens_per_s)} tok/s "
        f"(weights {run.weight_bytes / 2**30:.2f} GiB), llama-bench "
        f"{_cell(run.llama_decode_tokens_per_s)} tok/s",
        flush=True,
    )
    return run


# ------------------------------------------------------------------------------------------------ main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape: a smoke run")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--llama-cpp-bin", type=Path, default=DEFAULT_LLAMA_CPP_BIN)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument(
        "--models", default="moe,dense", help="comma-separated: moe, dense (default both)"
    )
    parser.add_argument("--skip-batched", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=None, help="default 64 (quick: 16)")
    parser.add_argument("--repeat", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument(
        "--batch", type=int, default=16, help="concurrent requests of the batched run"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args(argv)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _binary(args: argparse.Namespace, name: str) -> Path | None:
    if args.skip_llama_cpp:
        return None
    path = args.llama_cpp_bin / name
    if not path.is_file():
        _stderr(f"{path} not found (tools/build_llama_cpp.sh {name}): llama.cpp's side is skipped")
        return None
    return path


def _attempt(what: str, run: Callable[[], Any], errors: list[str]) -> Any:
    """`run()`, or None with the error recorded: one failing side still lets the others measure."""
    _stderr(f"{what} ...")
    try:
        return run()
    except Exception as error:  # report and go on
        errors.append(f"{what}: {type(error).__name__}: {error}")
        _stderr(errors[-1])
        return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    import torch

    shape = QUICK_SHAPE if args.quick else QWEN3_MOE_SHAPE
    output_len = args.output_len or (16 if args.quick else 64)
    repeat = args.repeat or (1 if args.quick else 3)
    threads = torch.get_num_threads()
    cpu_name, cpu_flags = cpu_description()
    argv_shown = argv if argv is not None else sys.argv[1:]
    total, active = shape.parameter_counts()
    print(f"# {COMMAND} {shlex.join(argv_shown)}")
    print(
        f"# {cpu_name}; {os.cpu_count()} CPUs; flags: {' '.join(cpu_flags)}; torch {torch.__version__}"
    )
    print(
        f"# moe: {shape}; {total / 1e9:.2f} B parameters, {active / 1e9:.2f} B active; dense: intermediate "
        f"{shape.moe_intermediate_size * shape.num_experts_per_tok}; {OUTTYPE} by tools/convert_to_gguf.py",
        flush=True,
    )
    bench, server = _binary(args, "llama-bench"), _binary(args, "llama-server")
    cache = args.cache_dir / ("quick" if args.quick else "qwen3-moe")
    wanted = {name.strip() for name in args.models.split(",") if name.strip()}
    if not wanted <= {"moe", "dense"}:
        raise SystemExit(f"--models: unknown {sorted(wanted - {'moe', 'dense'})} (moe, dense)")
    configs = {"moe": shape.moe_config(), "dense": shape.dense_config()}
    configs = {name: config for name, config in configs.items() if name in wanted}
    runs: dict[str, ModelRun] = {}
    errors: list[str] = []
    settings = SingleStreamSettings(shape.vocab_size, args.prompt_len, output_len, repeat, threads)
    for name, config in configs.items():
        run = single_stream(name, config, cache, settings, bench, errors)
        if run is not None:
            runs[name] = run

    batched: dict[str, BatchedResult] = {}
    if not args.skip_batched and "moe" in runs:
        workload = batch_workload(args.batch, shape.vocab_size, args.quick)
        max_model_len = max(map(len, workload.prompts)) + max(workload.output_lens) + 16
        moe = runs["moe"]
        tokenizer = cache / "moe"
        result = _attempt(
            "moe: kvflow serve batched",
            lambda: bench_kvflow_serve(
                {"model": str(moe.gguf), "tokenizer": str(tokenizer)}, workload, max_model_len
            ),
            errors,
        )
        if result is not None:
            batched["kvflow"] = result
        if server is not None:
            result = _attempt(
                "moe: llama-server batched",
                lambda: bench_llama_server(
                    server, moe.gguf, workload, threads, args.batch, max_model_len
                ),
                errors,
            )
            if result is not None:
                batched["llama.cpp"] = result
        for side, result in batched.items():
            print(
                f"batch-{args.batch} {side:<9} {result.elapsed_s:8.2f} s "
                f"{result.output_tokens_per_s:9.1f} out tok/s  ({result.name})",
                flush=True,
            )

    table = goals_table(runs, batched)
    print()
    print(table)
    for error in errors:
        print(f"failed: {error}")
    results: dict[str, Any] = {
        "command": f"{COMMAND} {shlex.join(argv_shown)}",
        "cpu": cpu_name,
        "cpu_flags": cpu_flags,
        "threads": threads,
        "shape": shape.__dict__,
        "parameters": {"total": total, "active": active},
        "runs": {
            name: {
                "kvflow_ms_per_token": run.kvflow_ms_per_token,
                "kvflow_tokens_per_s": run.kvflow_tokens_per_s,
                "llama_decode_tokens_per_s": run.llama_decode_tokens_per_s,
                "llama_command": run.llama_command,
                "weight_bytes": run.weight_bytes,
            }
            for name, run in runs.items()
        },
        "batched": {
            side: {"tokens_per_s": result.output_tokens_per_s, "detail": result.detail}
            for side, result in batched.items()
        },
        "errors": errors,
        "table": table,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
