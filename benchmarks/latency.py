"""Single-stream latency and memory: kvflow against floors measured in the same run, and against llama.cpp.

Reproduce with `python benchmarks/latency.py` (`--quick` for a seconds-long smoke run on a tiny shape). Add
`--llama-bench .cache/llama.cpp/bin/llama-bench --gguf FILE` for llama.cpp's figure (build it with
`tools/build_llama_cpp.sh`, convert the checkpoint with `python tools/convert_to_gguf.py CHECKPOINT FILE`; the
checkpoint's folder is printed in the header). `--json PATH` saves every figure.

Checkpoint: the random-weight Qwen2-0.5B-shaped bfloat16 checkpoint of `benchmarks/throughput.py` (same helper, same
seed; `--model` runs another checkpoint folder). Every figure comes from this run, one after the other, so only
ratios within one run compare (machines differ in ISA and load):
1. **kvflow decode**: `LLM(checkpoint, dtype="bfloat16", max_num_seqs=1)` (otherwise the defaults: async
   scheduling, prefix caching), one request at a time, a 32-token random prompt, 128 greedy tokens with
   `ignore_eos`. Decode time only: (last token's time - first token's time) / (tokens - 1), from
   the request's `RequestOutput.metrics`; an untimed warm-up request first, then the median of `--repeats`.
2. **torch GEMV floor**: the batch-1 matrix-vector products of one decode step alone, `F.linear` with one row on
   every weight the step reads (per layer qkv (+ bias), o, gate_up, down; then the LM head), bfloat16, each layer
   its own tensors as in the model; median of `--repeats` steps after a warm-up.
3. **memory floor**: the bytes of those weights (what one decode token must read) / the machine's read bandwidth,
   measured as the best of several `.sum()`s over a float32 tensor far larger than the caches.
4. **llama.cpp** (optional): `llama-bench -m FILE -p 0 -n 64 -t <torch's thread count> -o json`, its `avg_ts`.
5. **TTFT**: a 2048-token random prompt with `max_tokens=1` through the engine (arrival to first token, from the
   metrics) against the same prefill's forward passes replayed on the model alone (recorded while the engine ran
   them, as throughput.py's "forward only" does: no scheduler, input preparation, sampling or output processing).
6. **memory**: the KV cache's bytes per token from the allocated tensors (their nbytes / (blocks x block size))
   against `2 x layers x kv_heads x head_dim x dtype bytes`; and the peak RSS (VmHWM) of a fresh interpreter while
   it constructs `LLM(checkpoint)` with a fixed 64-block KV cache, minus that interpreter's RSS after
   `import torch` and `from kvflow import LLM`, against the loaded weights' bytes plus the KV cache's (VmHWM counts
   resident pages of a memory-mapped checkpoint file too).
The goals table at the end prints each latency goal as a ratio measured in this run, its target and PASS / MISS
(SKIP when not measured; "info" rows have no target).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.compute_floor import read_bandwidth  # the best `.sum()` over a large float32 tensor

COMMAND = "python benchmarks/latency.py"
LOAD_RSS_KV_BLOCKS = (
    64  # the fixed KV cache of the load-RSS measurement (blocks of the default 16 tokens)
)


# ------------------------------------------------------------------------------------------------ model shape
@dataclass(frozen=True)
class ModelShape:
    """What the floors and the KV formula need from config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    qkv_bias: bool

    @classmethod
    def from_checkpoint(cls, path: Path) -> ModelShape:
        config = json.loads((path / "config.json").read_text())
        num_heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads", num_heads)),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias")),
        )

    def decode_linear_shapes(self) -> list[tuple[int, int, bool]]:
        """(out_features, in_features, has_bias) of every matrix one decode token reads, in forward order."""
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        layer = [
            (qkv_out, self.hidden_size, self.qkv_bias),
            (self.hidden_size, self.num_heads * self.head_dim, False),
            (2 * self.intermediate_size, self.hidden_size, False),
            (self.hidden_size, self.intermediate_size, False),
        ]
        return layer * self.num_layers + [(self.vocab_size, self.hidden_size, False)]

    def kv_bytes_per_token_formula(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


# ------------------------------------------------------------------------------------------------ floors
@dataclass
class GemvFloor:
    step_s: float
    weight_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.step_s


def measure_gemv_floor(shape: ModelShape, dtype: torch.dtype, repeats: int) -> GemvFloor:
    """Median time of one decode step's `F.linear` calls with M=1 on freshly made weights of the model's shapes."""
    generator = torch.Generator().manual_seed(0)
    weights = [
        (
            torch.randn(out_features, in_features, generator=generator, dtype=dtype) * 0.02,
            torch.zeros(out_features, dtype=dtype) if bias else None,
        )
        for out_features, in_features, bias in shape.decode_linear_shapes()
    ]
    inputs = {
        in_features: torch.randn(1, in_features, generator=generator, dtype=dtype)
        for _, in_features, _ in shape.decode_linear_shapes()
    }
    weight_bytes = sum(w.nbytes + (b.nbytes if b is not None else 0) for w, b in weights)

    def step() -> None:
        for weight, bias in weights:
            F.linear(inputs[weight.shape[1]], weight, bias)

    with torch.inference_mode():
        step()  # warm-up: oneDNN primitive creation
        times = [_timed(step) for _ in range(repeats)]
    return GemvFloor(statistics.median(times), weight_bytes)


@contextmanager
def _stage(name: str) -> Iterator[None]:
    """Say on stderr what is being measured and how long it took (the table goes to stdout)."""
    print(f"{name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _timed(function: Callable[[], Any]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ kvflow
@dataclass
class DecodeResult:
    ms_per_token: list[float]  # one per timed repeat

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms_per_token)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 / self.median_ms


@dataclass
class TtftResult:
    engine_s: list[float]
    forward_s: list[float]
    num_forward_passes: int

    @property
    def ratio(self) -> float:
        return statistics.median(self.engine_s) / statistics.median(self.forward_s)


@dataclass
class KVCacheFacts:
    """The worker's KV cache as allocated."""

    num_bytes: int
    num_blocks: int
    block_size: int

    @property
    def bytes_per_token(self) -> float:
        return self.num_bytes / (self.num_blocks * self.block_size)


def _tensor_bytes(value: Any) -> int:
    """nbytes of a tensor, or the sum over a list / tuple / dict of them (a per-layer cache)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    raise TypeError(f"unexpected KV cache element {type(value).__name__}")


def kv_cache_facts(worker: Any) -> KVCacheFacts:
    """The `collective_rpc` target: bytes and geometry of the worker's allocated KV cache."""
    return KVCacheFacts(
        _tensor_bytes(worker.model_runner.kv_cache),
        int(worker.num_kv_blocks),
        int(worker.engine_config.cache_config.block_size),
    )


def weight_bytes(worker: Any) -> int:
    """The `collective_rpc` target: bytes of the model's parameters, each storage once (tied embeddings)."""
    storages: dict[int, int] = {}
    for parameter in worker.model.parameters():
        storage = parameter.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _worker(llm: Any) -> Any:
    """The in-process worker (the default "uni" executor), as throughput.py reaches it."""
    return llm.run_in_engine(lambda core: core.executor.worker)


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(length)]}


def measure_decode(
    llm: Any, vocab_size: int, prompt_len: int, output_len: int, repeats: int
) -> DecodeResult:
    """ms per decode token of one request at a time (fresh random prompts: no prefix-cache hits)."""
    from kvflow import SamplingParams

    rng = random.Random(1)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate([_random_prompt(rng, prompt_len, vocab_size)], params, use_tqdm=False)  # warm-up
    ms_per_token = []
    for _ in range(repeats):
        (output,) = llm.generate(
            [_random_prompt(rng, prompt_len, vocab_size)], params, use_tqdm=False
        )
        metrics = output.metrics
        num_tokens = len(output.outputs[0].token_ids)
        assert num_tokens == output_len, (num_tokens, output_len)
        assert metrics is not None and metrics.first_token_time and metrics.last_token_time
        decode_s = metrics.last_token_time - metrics.first_token_time
        ms_per_token.append(1000.0 * decode_s / (num_tokens - 1))
    return DecodeResult(ms_per_token)


def measure_ttft(llm: Any, vocab_size: int, prompt_len: int, repeats: int) -> TtftResult:
    """Engine TTFT of a `prompt_len` prompt vs its prefill forward passes replayed on the bare model."""
    from kvflow import SamplingParams

    rng = random.Random(2)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    model = _worker(llm).model_runner.model
    forward = model.forward
    recorded: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def recording_forward(*args: Any, **kwargs: Any) -> Any:
        recorded.append((args, kwargs))
        return forward(*args, **kwargs)

    def prefill_passes() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The recorded passes up to the prompt's last token (a pass planned ahead may follow)."""
        passes, num_tokens = [], 0
        for args, kwargs in recorded:
            passes.append((args, kwargs))
            batch = args[0] if args else kwargs["batch"]
            num_tokens += int(batch.num_tokens)
            if num_tokens >= prompt_len:
                break
        return passes

    engine_s, forward_s, num_passes = [], [], 0
    for attempt in range(repeats + 1):  # the first is an untimed warm-up
        llm.reset_prefix_cache()
        recorded.clear()
        model.forward = recording_forward
        try:
            (output,) = llm.generate(
                [_random_prompt(rng, prompt_len, vocab_size)], params, use_tqdm=False
            )
        finally:
            model.forward = forward
        metrics = output.metrics
        assert metrics is not None and metrics.first_token_time is not None
        passes = prefill_passes()
        if not passes:
            raise RuntimeError(
                "no forward pass was recorded: the runner no longer calls model.forward"
            )
        with torch.inference_mode():
            start = time.perf_counter()
            for args, kwargs in passes:
                forward(*args, **kwargs)
            replay_s = time.perf_counter() - start
        if attempt > 0:
            engine_s.append(metrics.first_token_time - metrics.arrival_time)
            forward_s.append(replay_s)
            num_passes = len(passes)
    return TtftResult(engine_s, forward_s, num_passes)


# ------------------------------------------------------------------------------------------------ load RSS
def _proc_status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def load_rss_child(path: Path, dtype: str) -> dict[str, int]:
    """Run in a fresh interpreter: RSS before / peak during `LLM(path)` construction, and what it allocated."""
    from kvflow import LLM

    baseline_rss = _proc_status_bytes("VmRSS")
    llm = LLM(
        str(path),
        dtype=dtype,
        skip_tokenizer_init=True,
        num_kv_blocks=LOAD_RSS_KV_BLOCKS,
        max_model_len=LOAD_RSS_KV_BLOCKS * 16,
        max_num_seqs=1,
        disable_log_stats=True,
    )
    peak_rss = _proc_status_bytes("VmHWM")
    (kv,) = llm.collective_rpc(kv_cache_facts)
    (weights,) = llm.collective_rpc(weight_bytes)
    return {
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_bytes": peak_rss,
        "weight_bytes": weights,
        "kv_cache_bytes": kv.num_bytes,
    }


@dataclass
class LoadMemory:
    baseline_rss_bytes: int
    peak_rss_bytes: int
    weight_bytes: int
    kv_cache_bytes: int

    @property
    def ratio(self) -> float:
        """Peak RSS growth while loading over what the engine must hold (weights + KV cache)."""
        return (self.peak_rss_bytes - self.baseline_rss_bytes) / (
            self.weight_bytes + self.kv_cache_bytes
        )


def measure_load_rss(path: Path, dtype: str) -> LoadMemory:
    """`load_rss_child` in a fresh interpreter (this one's high-water mark already holds other runs)."""
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--load-rss-child", str(path), dtype],
        capture_output=True,
        text=True,
        check=False,
        env=os.environ.copy(),
    )
    if completed.returncode != 0:
        raise RuntimeError(f"the load-RSS interpreter failed:\n{completed.stderr[-4000:]}")
    return LoadMemory(**json.loads(completed.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------------------------ llama.cpp
@dataclass
class LlamaBenchResult:
    tokens_per_s: float
    command: str


def run_llama_bench(binary: Path, gguf: Path, threads: int, num_tokens: int) -> LlamaBenchResult:
    """llama.cpp's decode speed on `gguf`: llama-bench's `avg_ts` of its token-generation test."""
    command = [
        str(binary),
        "-m",
        str(gguf),
        "-p",
        "0",
        "-n",
        str(num_tokens),
        "-t",
        str(threads),
        "-o",
        "json",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{completed.stderr[-4000:]}")
    results = json.loads(completed.stdout)
    generation = [result for result in results if int(result.get("n_gen", 0)) > 0]
    if not generation:
        raise RuntimeError(f"llama-bench printed no token-generation result: {completed.stdout!r}")
    return LlamaBenchResult(float(generation[0]["avg_ts"]), shlex.join(command))


# ------------------------------------------------------------------------------------------------ goals
@dataclass
class Goal:
    """One row of the goals table. `target` is None for info rows; `measured` None when not measured (SKIP)."""

    name: str
    measured: float | None
    comparison: str  # ">", "<=", "==" or "" (info)
    target: float | None

    @property
    def status(self) -> str:
        if self.measured is None:
            return "SKIP"
        if self.target is None:
            return "info"
        if self.comparison == ">":
            return "PASS" if self.measured > self.target else "MISS"
        if self.comparison == "<=":
            return "PASS" if self.measured <= self.target else "MISS"
        return "PASS" if abs(self.measured - self.target) < 1e-9 else "MISS"


def format_goals(goals: Sequence[Goal]) -> str:
    lines = [f"{'goal':<48}{'measured':>10}{'target':>10}  status"]
    for goal in goals:
        measured = "-" if goal.measured is None else f"{goal.measured:.3f}"
        target = "-" if goal.target is None else f"{goal.comparison} {goal.target:g}"
        lines.append(f"{goal.name:<48}{measured:>10}{target:>10}  {goal.status}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main
def cpu_name_and_flags() -> tuple[str, set[str]]:
    """The CPU's model name and feature flags from /proc/cpuinfo (the platform's processor name and no flags where
    there is none)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return name, flags


def describe_cpu() -> str:
    """The CPU's model name and whether it has the bf16 matrix instructions that decide bf16 GEMV speed."""
    name, flags = cpu_name_and_flags()
    features = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    return f"{name} ({', '.join(features) or 'no avx512'})"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shape, short runs (smoke run)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None, help="another checkpoint folder")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5)")
    parser.add_argument("--llama-bench", type=Path, default=None, help="llama-bench binary")
    parser.add_argument("--gguf", type=Path, default=None, help="the checkpoint as GGUF")
    parser.add_argument("--json", type=Path, default=None, help="save every figure here")
    parser.add_argument(
        "--load-rss-child", nargs=2, metavar=("PATH", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if (args.llama_bench is None) != (args.gguf is None):
        parser.error("--llama-bench and --gguf go together")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.load_rss_child is not None:
        print(json.dumps(load_rss_child(Path(args.load_rss_child[0]), args.load_rss_child[1])))
        return {}
    from benchmarks import throughput
    from kvflow import LLM

    quick = args.quick
    repeats = args.repeats or (2 if quick else 5)
    prompt_len, output_len = (16, 16) if quick else (32, 128)
    ttft_prompt_len = 256 if quick else 2048
    bandwidth_bytes = (64 if quick else 1024) * 2**20
    dtype = torch.bfloat16
    if args.model is not None:
        path = args.model
    else:
        cache_root = Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
        shape_dict = throughput.QUICK_SHAPE if quick else throughput.QWEN2_05B_SHAPE
        name = "bench-quick" if quick else "bench-qwen2-0.5b-shape"
        path = throughput.ensure_checkpoint(args.checkpoint_dir or cache_root / name, shape_dict)
    shape = ModelShape.from_checkpoint(path)
    threads = torch.get_num_threads()

    with _stage("torch GEMV floor and read bandwidth"):
        gemv = measure_gemv_floor(shape, dtype, repeats)
        bandwidth = read_bandwidth(bandwidth_bytes, repeats)
    memory_floor_s = gemv.weight_bytes / bandwidth

    with _stage("kvflow decode and TTFT"):
        max_model_len = ttft_prompt_len + 256
        llm = LLM(
            str(path),
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(ttft_prompt_len, 2048),
            num_kv_blocks=2 * -(-max_model_len // 16),
            max_num_seqs=1,
            disable_log_stats=True,
        )
        decode = measure_decode(llm, shape.vocab_size, prompt_len, output_len, repeats)
        ttft = measure_ttft(llm, shape.vocab_size, ttft_prompt_len, repeats)
        (kv,) = llm.collective_rpc(kv_cache_facts)
        llm.shutdown()
    kv_formula = shape.kv_bytes_per_token_formula(dtype)

    with _stage("peak RSS while loading, in a fresh interpreter"):
        load = measure_load_rss(path, "bfloat16")

    llama = None
    if args.llama_bench is not None:
        with _stage("llama-bench"):
            llama = run_llama_bench(args.llama_bench, args.gguf, threads, 64)

    argv_shown = argv if argv is not None else sys.argv[1:]
    print(f"# {COMMAND} {shlex.join(argv_shown)}")
    print(
        f"# {describe_cpu()}, torch {torch.__version__}, {threads} threads; "
        f"checkpoint {path} ({shape.num_layers} layers, hidden {shape.hidden_size}, bf16)"
    )
    print(
        f"# decode: 1 request, {prompt_len}-token prompt, {output_len} greedy tokens, median of {repeats}; "
        f"TTFT prompt {ttft_prompt_len} tokens ({ttft.num_forward_passes} prefill pass(es))"
    )
    rows = [
        ("kvflow decode", decode.median_ms, decode.tokens_per_s),
        ("torch GEMV floor", 1000.0 * gemv.step_s, gemv.tokens_per_s),
        ("memory floor", 1000.0 * memory_floor_s, 1.0 / memory_floor_s),
    ]
    if llama is not None:
        rows.append(("llama.cpp (llama-bench)", 1000.0 / llama.tokens_per_s, llama.tokens_per_s))
    print(f"{'single stream':<26}{'ms/token':>10}{'tok/s':>10}")
    for name, ms, tok_s in rows:
        print(f"{name:<26}{ms:>10.2f}{tok_s:>10.1f}")
    print(
        f"weights read per token {gemv.weight_bytes / 1e9:.3f} GB; read bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(best float32 .sum() over {bandwidth_bytes // 2**20} MiB); GEMV streams "
        f"{gemv.weight_bytes / gemv.step_s / 1e9:.1f} GB/s"
    )
    if llama is not None:
        print(f"llama.cpp: {llama.command}")
    print(
        f"TTFT {ttft_prompt_len} tokens: engine {1000 * statistics.median(ttft.engine_s):.1f} ms, "
        f"bare forward {1000 * statistics.median(ttft.forward_s):.1f} ms"
    )
    print(
        f"KV cache: {kv.bytes_per_token:.1f} bytes/token measured ({kv.num_bytes} bytes / "
        f"({kv.num_blocks} blocks x {kv.block_size})), formula 2 x {shape.num_layers} x "
        f"{shape.num_kv_heads} x {shape.head_dim} x 2 = {kv_formula}"
    )
    print(
        f"load: peak RSS {load.peak_rss_bytes / 2**20:.0f} MiB - baseline {load.baseline_rss_bytes / 2**20:.0f} "
        f"MiB (fresh interpreter after import torch, kvflow) vs weights {load.weight_bytes / 2**20:.0f} MiB + "
        f"KV {load.kv_cache_bytes / 2**20:.1f} MiB"
    )
    goals = [
        Goal(
            "decode tok/s: kvflow / llama.cpp",
            None if llama is None else decode.tokens_per_s / llama.tokens_per_s,
            ">",
            1.0,
        ),
        Goal(
            "decode tok/s: kvflow / torch GEMV floor",
            decode.tokens_per_s / gemv.tokens_per_s,
            "",
            None,
        ),
        Goal("decode tok/s: kvflow / memory floor", decode.tokens_per_s * memory_floor_s, "", None),
        Goal(f"TTFT {ttft_prompt_len} tokens: engine / bare forward", ttft.ratio, "<=", 1.1),
        Goal("KV bytes/token: measured / formula", kv.bytes_per_token / kv_formula, "==", 1.0),
        Goal("peak RSS during load / (weights + KV)", load.ratio, "<=", 1.2),
    ]
    print(format_goals(goals))

    results: dict[str, Any] = {
        "command": f"{COMMAND} {shlex.join(argv_shown)}",
        "machine": describe_cpu(),
        "torch": torch.__version__,
        "threads": threads,
        "checkpoint": str(path),
        "shape": asdict(shape),
        "decode_ms_per_token": decode.ms_per_token,
        "decode_tokens_per_s": decode.tokens_per_s,
        "gemv_floor_tokens_per_s": gemv.tokens_per_s,
        "weight_bytes_per_token": gemv.weight_bytes,
        "read_bandwidth_bytes_per_s": bandwidth,
        "memory_floor_tokens_per_s": 1.0 / memory_floor_s,
        "llama_cpp_tokens_per_s": None if llama is None else llama.tokens_per_s,
        "llama_cpp_command": None if llama is None else llama.command,
        "ttft_engine_s": ttft.engine_s,
        "ttft_forward_s": ttft.forward_s,
        "kv_cache": {**asdict(kv), "bytes_per_token": kv.bytes_per_token, "formula": kv_formula},
        "load_memory": {**asdict(load), "ratio": load.ratio},
        "goals": [{**asdict(goal), "status": goal.status} for goal in goals],
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
