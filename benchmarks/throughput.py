"""Offline throughput: kvflow against Hugging Face transformers static batching, same checkpoint, same workload.

Reproduce with `python benchmarks/throughput.py` (`--quick` for a seconds-long smoke run on a tiny shape).

Workload (fixed by seed 0): 64 requests, prompt lengths uniform in [32, 256], output lengths uniform in [32, 128],
random token ids, `ignore_eos`, greedy. The checkpoint is a random-weight model shaped like Qwen2-0.5B (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 32000, tied embeddings) saved in bfloat16 and created
locally on first use (under `$KVFLOW_CACHE_DIR`, default `~/.cache/kvflow`).

Systems, run one after the other in this process:
1. **HF static**: `AutoModelForCausalLM` (SDPA attention) in bfloat16, requests in batches of 16 in arrival order,
   left padding, `generate(max_new_tokens = the batch's longest output)`. A batch ends when its longest request
   does; only each request's own output length counts as useful tokens.
2. **kvflow**: `LLM(checkpoint, dtype="bfloat16")` (async scheduling: step N+1 is planned while step N runs)
   generating all requests at once, each with its own `max_tokens`.
3. **kvflow forward only**: every batch kvflow's runner ran in (2), replayed through the same model's `forward`
   on the same KV cache, with no scheduler, input preparation, sampling or output processing. Its time is the best
   kvflow could do with its own forward pass; the engine's overhead is (2) over (3).
4. **kvflow sync**: (2) with `async_scheduling=False` (schedule, run, update, one after the other).
5. **compute floor** (`compute_floor.py`): the time the model's linear layers alone take for every forward pass of
   (2), each at that pass's row count, measured on this machine in this run (best of 3 per shape and row count on a
   grid, interpolated; at each point the faster of `F.linear` and kvflow's own GEMV/GEMM kernel, the lines
   "floor GEMM ..." say which; up to 64 rows each product reads its weight from memory, as a forward pass does,
   not from the cache). Attention, norms, RoPE, sampling and scheduling are all above it.
6. **physical floor** (`compute_floor.PhysicalFloor`): the same passes bounded by the hardware alone, each at
   max(its linear weights' bytes / the read bandwidth measured here, its FLOPs / the best 4096^3 matmul rate
   measured here). The compute floor can only be as low as the products kvflow calls; this one says what those
   products leave on the table (on a CPU with AMX, when bf16 GEMMs still went through oneDNN, the two differed
   ~2x; since, kvflow's AMX kernel takes them, not yet measured on such a CPU).
Each system gets an untimed warm-up generation first. Output tokens/s = useful output tokens / wall time.

Goals, printed as ratios measured in the same run: kvflow's throughput >= 0.8 of the compute floor's
(floor seconds / kvflow seconds), >= 0.6 of the physical floor's, and >= 3x HF static.

`--model default --skip-hf --num-requests 256` runs the kvflow systems on the built-in default model instead (a
small trained Llama), where per-step CPU work is large next to the forward pass, so the async/sync ratio shows
what overlapping costs or buys when the "device" is the same CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.compute_floor import GemmFloor, PhysicalFloor

COMMAND = "python benchmarks/throughput.py"
QWEN2_05B_SHAPE = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 32000,
}
QUICK_COLD_BYTES = 4 * 2**20
QUICK_PHYSICAL_FLOOR_SIZES = {"bandwidth_bytes": 4 * 2**20, "matmul_size": 256}
QUICK_SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 1000,
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    name: str
    elapsed_s: float
    num_output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


def make_workload(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_range))]
        for _ in range(num_requests)
    ]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    return Workload(prompts, output_lens)


def ensure_checkpoint(path: Path, shape: dict[str, int]) -> Path:
    """A random-weight Qwen2 checkpoint of `shape` in bfloat16 (seed 0), created once and reused."""
    marker = path / "kvflow-benchmark.json"
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        return path
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **shape,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(shape))
    return path


def run_hf(path: Path, workload: Workload, batch_size: int) -> Result:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model.eval()

    def generate(prompts: list[list[int]], max_new_tokens: int) -> None:
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + max_new_tokens

    generate(workload.prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        generate(
            workload.prompts[first : first + batch_size],
            max(workload.output_lens[first : first + batch_size]),
        )
    return Result("HF static", time.perf_counter() - start, workload.num_output_tokens)


def run_kvflow(
    path: Path,
    workload: Workload,
    engine_kwargs: dict[str, Any],
    name: str = "kvflow",
    measure_floor: bool = False,
    floor_cold_bytes: int | None = None,
    physical_floor_sizes: dict[str, int] | None = None,
) -> tuple[Result, Result, Result | None, Result | None]:
    """kvflow's engine run, the replay of its forward passes and (with `measure_floor`) their compute floor and
    physical floor (`physical_floor_sizes`: `PhysicalFloor.measure`'s bandwidth_bytes / matmul_size, for a smoke
    run's)."""
    from kvflow import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, **engine_kwargs)
    runner = llm.run_in_engine(lambda core: core.executor.worker.model_runner)
    llm.generate(
        [{"prompt_token_ids": workload.prompts[0]}],
        SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
        use_tqdm=False,
    )
    llm.reset_prefix_cache()
    recorded: list[Any] = []
    forward = runner.model.forward

    def recording_forward(batch: Any, kv_cache: torch.Tensor) -> torch.Tensor:
        recorded.append(batch)
        return forward(batch, kv_cache)

    runner.model.forward = recording_forward  # type: ignore[method-assign]
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in workload.prompts], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    runner.model.forward = forward  # type: ignore[method-assign]
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)

    with torch.inference_mode():
        start = time.perf_counter()
        for batch in recorded:
            forward(batch, runner.kv_cache)
        forward_elapsed = time.perf_counter() - start
    mean_tokens = sum(batch.num_tokens for batch in recorded) / len(recorded)
    mean_reqs = sum(batch.num_reqs for batch in recorded) / len(recorded)
    print(
        f"kvflow ran {len(recorded)} forward passes; mean batch {mean_tokens:.1f} tokens, {mean_reqs:.1f} requests",
        file=sys.stderr,
    )
    floor_result = None
    if measure_floor:
        passes = [(batch.num_tokens, int(batch.logits_indices.numel())) for batch in recorded]
        floor = GemmFloor.measure(
            runner.model,
            passes,
            dtype=runner.model.dtype,
            **({} if floor_cold_bytes is None else {"cold_bytes": floor_cold_bytes}),
        )
        floor_result = Result("compute floor", floor.seconds, produced)
        print(
            f"compute floor: {floor.flops / 1e12:.2f} TFLOP in linear layers over {floor.num_passes} passes, "
            f"{floor.gflops_per_s:.0f} GFLOP/s",
            file=sys.stderr,
        )
        for line in floor.sources():
            print(line, file=sys.stderr)
    llm.shutdown()
    physical_result = None
    if measure_floor:
        physical = PhysicalFloor.measure(
            runner.model,
            passes,
            dtype=runner.model.dtype,
            **(physical_floor_sizes or {}),
        )
        physical_result = Result("physical floor", physical.seconds, produced)
        print(physical.describe(), file=sys.stderr)
    return (
        Result(name, elapsed, produced),
        Result(f"{name} forward only", forward_elapsed, produced),
        floor_result,
        physical_result,
    )


def _model_path(model: str) -> Path:
    if model == "default":
        from kvflow.default_model import ensure_default_model

        return ensure_default_model()
    return Path(model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shape and workload (smoke run)")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--skip-sync", action="store_true", help="skip the synchronous-scheduling kvflow run"
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument(
        "--model",
        default=None,
        help="run on this checkpoint folder instead ('default': kvflow's built-in default model)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args(argv)

    shape = QUICK_SHAPE if args.quick else QWEN2_05B_SHAPE
    num_requests = args.num_requests or (8 if args.quick else 64)
    prompt_range, output_range = ((8, 32), (4, 16)) if args.quick else ((32, 256), (32, 128))
    cache_root = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    name = "bench-quick" if args.quick else "bench-qwen2-0.5b-shape"
    if args.model is not None:
        path = _model_path(args.model)
        shape = {key: json.loads((path / "config.json").read_text())[key] for key in QUICK_SHAPE}
    else:
        path = ensure_checkpoint(args.checkpoint_dir or cache_root / name, shape)
    workload = make_workload(num_requests, prompt_range, output_range, shape["vocab_size"], seed=0)

    results: list[Result] = []
    if not args.skip_hf:
        results.append(run_hf(path, workload, args.batch_size))
        print(
            f"HF static: {results[0].elapsed_s:.2f} s, {results[0].output_tokens_per_s:.1f} output tok/s",
            file=sys.stderr,
        )
    engine_kwargs = {"max_num_seqs": args.max_num_seqs, "max_model_len": 512}
    kvflow_result, forward_result, floor_result, physical_result = run_kvflow(
        path,
        workload,
        {**engine_kwargs, "async_scheduling": True},
        measure_floor=True,
        # A smoke run's tiny weights would need thousands of copies to fill the sweep; its floor means nothing.
        floor_cold_bytes=QUICK_COLD_BYTES if args.quick else None,
        physical_floor_sizes=QUICK_PHYSICAL_FLOOR_SIZES if args.quick else None,
    )
    assert floor_result is not None and physical_result is not None
    results += [kvflow_result, forward_result]
    sync_result = None
    if not args.skip_sync:
        sync_result, _, _, _ = run_kvflow(
            path, workload, {**engine_kwargs, "async_scheduling": False}, "kvflow sync"
        )
        results.append(sync_result)

    print(f"# {COMMAND} {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; shape {shape}"
    )
    print(
        f"# {num_requests} requests, prompt tokens {sum(map(len, workload.prompts))}, "
        f"useful output tokens {workload.num_output_tokens}"
    )
    results += [floor_result, physical_result]
    print(f"{'system':<22}{'elapsed s':>11}{'output tok/s':>14}")
    for result in results:
        print(f"{result.name:<22}{result.elapsed_s:>11.2f}{result.output_tokens_per_s:>14.1f}")
    goals = [
        ("kvflow / compute floor", floor_result.elapsed_s / kvflow_result.elapsed_s, 0.8),
        ("kvflow / physical floor", physical_result.elapsed_s / kvflow_result.elapsed_s, 0.6),
    ]
    if not args.skip_hf:
        speedup = kvflow_result.output_tokens_per_s / results[0].output_tokens_per_s
        print(f"kvflow / HF static throughput: {speedup:.2f}x")
        goals.append(("kvflow / HF static", speedup, 3.0))
    print(
        f"kvflow engine time / forward-only time: {kvflow_result.elapsed_s / forward_result.elapsed_s:.3f}"
    )
    if sync_result is not None:
        print(
            f"kvflow async / sync scheduling throughput: "
            f"{kvflow_result.output_tokens_per_s / sync_result.output_tokens_per_s:.3f}x"
        )
    print(f"{'goal':<26}{'measured':>10}{'target':>9}  result")
    for goal, measured, target in goals:
        verdict = "PASS" if measured >= target else "MISS"
        print(f"{goal:<26}{measured:>10.3f}{'>= ' + format(target, 'g'):>9}  {verdict}")


if __name__ == "__main__":
    main()
