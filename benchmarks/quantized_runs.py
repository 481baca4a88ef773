"""benchmarks/quantized.py's measurements: llama-bench and llama-server, kvflow's single-stream decode and prefill,
its in-process LLM.generate and `kvflow serve` on the batched workload."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.quantized_checkpoint import SERVER_START_TIMEOUT_S, Settings, run_logged


# ------------------------------------------------------------------------------------------------ llama.cpp
@dataclass
class LlamaBenchResult:
    decode_tokens_per_s: float | None
    prefill_tokens_per_s: float | None
    command: str


def llama_bench_command(
    binary: Path, gguf: Path, threads: int, output_len: int, prefill_len: int, repeat: int
) -> list[str]:
    """pp`prefill_len` and tg`output_len` in one call (llama-bench runs -p and -n as separate tests)."""
    return [
        str(binary),
        "-m",
        str(gguf),
        "-p",
        str(prefill_len),
        "-n",
        str(output_len),
        "-t",
        str(threads),
        "-r",
        str(repeat),
        "-o",
        "json",
    ]


def parse_llama_bench(stdout: str, command: str) -> LlamaBenchResult:
    """avg_ts of the token-generation test (n_gen > 0, n_prompt 0) and of the prompt test (n_prompt > 0, n_gen 0)."""
    decode = prefill = None
    for result in json.loads(stdout):
        n_prompt, n_gen = int(result.get("n_prompt", 0)), int(result.get("n_gen", 0))
        if n_gen > 0 and n_prompt == 0:
            decode = float(result["avg_ts"])
        elif n_prompt > 0 and n_gen == 0:
            prefill = float(result["avg_ts"])
    return LlamaBenchResult(decode, prefill, command)


def run_llama_bench(
    binary: Path, gguf: Path, threads: int, output_len: int, prefill_len: int, repeat: int
) -> LlamaBenchResult:
    command = llama_bench_command(binary, gguf, threads, output_len, prefill_len, repeat)
    completed = run_logged(command, "llama-bench")
    return parse_llama_bench(completed.stdout, shlex.join(command))


@contextmanager
def running_server(
    command: list[str], base_url: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`serving.healthy_process` with this benchmark's start timeout (a 1B model loads for minutes here)."""
    from benchmarks import serving

    with serving.healthy_process(command, base_url, env, SERVER_START_TIMEOUT_S) as server:
        yield server


def llama_server_command(
    binary: Path, gguf: Path, port: int, threads: int, parallel: int, context: int
) -> list[str]:
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(parallel),
        "-c",
        str(context),
        "--no-warmup",
    ]


def llama_completion_payload(prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "n_predict": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
    }


def kvflow_completion_payload(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def llama_output_tokens(response: dict[str, Any]) -> int:
    return int(response["tokens_predicted"])


def kvflow_output_tokens(response: dict[str, Any]) -> int:
    return int(response["usage"]["completion_tokens"])


def finite_top_logprobs(response: dict[str, Any]) -> bool:
    """Whether llama-server's `completion_probabilities` hold at least one number and all are finite (a model
    that overflows gives NaN)."""
    values: list[float] = []

    def collect(item: Any) -> None:
        if isinstance(item, dict):
            for key, value in item.items():
                if key in ("logprob", "prob") and isinstance(value, int | float):
                    values.append(float(value))
                else:
                    collect(value)
        elif isinstance(item, list):
            for value in item:
                collect(value)

    collect(response.get("completion_probabilities"))
    return bool(values) and all(math.isfinite(value) for value in values)


@dataclass
class BatchedResult:
    name: str
    elapsed_s: float
    num_output_tokens: int
    detail: str = ""

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


def drive_http(
    url: str,
    payloads: list[dict[str, Any]],
    count_tokens: Callable[[dict[str, Any]], int],
) -> tuple[float, int]:
    """Send every payload at once (one connection each) and wait for all: (wall seconds, output tokens)."""
    import httpx

    async def run() -> tuple[float, int]:
        limits = httpx.Limits(max_connections=len(payloads) + 1)
        async with httpx.AsyncClient(timeout=3600.0, limits=limits) as client:

            async def one(payload: dict[str, Any]) -> int:
                response = await client.post(url, json=payload)
                response.raise_for_status()
                return count_tokens(response.json())

            start = time.perf_counter()
            tokens = await asyncio.gather(*(one(payload) for payload in payloads))
            return time.perf_counter() - start, sum(tokens)

    return asyncio.run(run())


def bench_llama_server(
    binary: Path, gguf: Path, workload: Any, threads: int, parallel: int, max_model_len: int
) -> BatchedResult:
    """The workload through llama-server with `parallel` slots (`-c` = 64 slots of `max_model_len`)."""
    import httpx

    from benchmarks import serving

    port = serving.free_port()
    base_url = f"http://127.0.0.1:{port}"
    context = max(parallel, len(workload.prompts)) * max_model_len
    command = llama_server_command(binary, gguf, port, threads, parallel, context)
    with running_server(command, base_url):
        warm_up = {**llama_completion_payload(workload.prompts[0][:16], 4), "n_probs": 4}
        response = httpx.post(base_url + "/completion", json=warm_up, timeout=600).json()
        if not finite_top_logprobs(response):
            raise RuntimeError(
                f"llama-server's log-probabilities are not finite on {gguf}: "
                f"{json.dumps(response.get('completion_probabilities'))[:500]}"
            )
        payloads = [
            llama_completion_payload(prompt, output_len)
            for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True)
        ]
        elapsed, tokens = drive_http(base_url + "/completion", payloads, llama_output_tokens)
    if tokens != workload.num_output_tokens:
        raise RuntimeError(
            f"llama-server produced {tokens} tokens, not {workload.num_output_tokens}"
        )
    return BatchedResult(f"llama-server -np {parallel}", elapsed, tokens, shlex.join(command))


# ------------------------------------------------------------------------------------------------ kvflow
@dataclass
class KvflowResult:
    """kvflow's figures for one format."""

    decode_ms_per_token: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    weight_bytes: int = 0
    model_dtype: str = ""
    # the same decode with the fused decode layer off (every layer per op), measured after it; empty: no fused path
    per_op_decode_ms_per_token: list[float] = field(default_factory=list)
    # `--alternate` rounds: (kvflow decode tok/s, llama.cpp tg tok/s) timed one right after the other
    alternated: list[tuple[float, float]] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return 1000.0 / statistics.median(self.decode_ms_per_token)

    @property
    def per_op_decode_tokens_per_s(self) -> float | None:
        if not self.per_op_decode_ms_per_token:
            return None
        return 1000.0 / statistics.median(self.per_op_decode_ms_per_token)

    @property
    def alternated_ratios(self) -> list[float]:
        """kvflow / llama.cpp decode of each alternated round."""
        return [kvflow / llama for kvflow, llama in self.alternated]

    def prefill_tokens_per_s(self, prefill_len: int) -> float:
        return prefill_len / statistics.median(self.prefill_s)


def resident_weight_bytes(worker: Any) -> int:
    """The `collective_rpc` target: bytes of the model's parameters and buffers, each storage once (tied
    embeddings, views); the KV cache lives in the runner, not the model."""
    import torch

    storages: dict[int, int] = {}
    tensors = [*worker.model.parameters(), *worker.model.buffers()]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_dtype(worker: Any) -> str:
    """The `collective_rpc` target: the dtypes of the model's parameters and buffers, most bytes first."""
    totals: dict[str, int] = {}
    for tensor in [*worker.model.parameters(), *worker.model.buffers()]:
        name = str(tensor.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + tensor.nbytes
    return ", ".join(name for name, _ in sorted(totals.items(), key=lambda item: -item[1]))


def measure_prefill(llm: Any, vocab_size: int, prompt_len: int, repeat: int) -> list[float]:
    """Seconds from arrival to the first token of fresh `prompt_len`-token prompts (warm-up first)."""
    from kvflow import SamplingParams

    rng = random.Random(2)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for attempt in range(repeat + 1):
        llm.reset_prefix_cache()
        prompt = {"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(prompt_len)]}
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        metrics = output.metrics
        assert metrics is not None and metrics.first_token_time is not None
        if attempt > 0:
            times.append(metrics.first_token_time - metrics.arrival_time)
    return times


def kvflow_model_kwargs(fmt: str, files: dict[str, Path], checkpoint: Path) -> dict[str, Any]:
    """What `LLM(...)` / `kvflow serve` get for a format: the GGUF file and the tokenizer folder, or the folder
    with `quantization="int8"` and the (tied) LM head quantized too, as llama.cpp's Q8_0 file holds it."""
    if fmt == "int8":
        return {
            "model": str(checkpoint),
            "quantization": "int8",
            "quantize_lm_head": True,
            "dtype": "bfloat16",
        }
    return {"model": str(files[fmt]), "tokenizer": str(checkpoint)}


def llama_decode_only(
    binary: Path, gguf: Path, threads: int, output_len: int
) -> Callable[[], float | None]:
    """A call that runs llama-bench's tg`output_len` alone once (`-p 0 -r 1`) and returns its tok/s."""

    def run() -> float | None:
        return run_llama_bench(binary, gguf, threads, output_len, 0, 1).decode_tokens_per_s

    return run


def run_kvflow_single(
    model_kwargs: dict[str, Any],
    settings: Settings,
    vocab_size: int,
    llama_decode: Callable[[], float | None] | None = None,
    rounds: int = 0,
) -> KvflowResult:
    """Decode and prefill of one request at a time, and the loaded model's weight bytes. With `llama_decode`,
    then `rounds` alternated rounds: one kvflow decode timing, then `llama_decode()` right after it (the model
    stays loaded and idle meanwhile), so each round's ratio sees the host's memory bandwidth of that moment."""
    from benchmarks import latency
    from kvflow import LLM

    llm = LLM(
        **model_kwargs,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=max(settings.max_model_len, 2048),
        num_kv_blocks=2 * -(-settings.max_model_len // 16),
        max_num_seqs=1,
        disable_log_stats=True,
    )
    try:
        # Decode timings alternate with the same decode per op (the fused decode layer off), when the model
        # has a fused path: the same-run A/B of that path, each side warmed up before each timing.
        has_fused = llm.collective_rpc(set_fused_decode(True)) == [True]
        decode_ms: list[float] = []
        per_op: list[float] = []
        for _ in range(settings.repeat):
            decode_ms += latency.measure_decode(
                llm, vocab_size, settings.prompt_len, settings.output_len, 1
            ).ms_per_token
            if has_fused:
                llm.collective_rpc(set_fused_decode(False))
                per_op += latency.measure_decode(
                    llm, vocab_size, settings.prompt_len, settings.output_len, 1
                ).ms_per_token
                llm.collective_rpc(set_fused_decode(True))
        alternated: list[tuple[float, float]] = []
        for _ in range(rounds if llama_decode is not None else 0):
            round_ms = latency.measure_decode(
                llm, vocab_size, settings.prompt_len, settings.output_len, 1
            ).ms_per_token
            llama_tokens_per_s = llama_decode()  # type: ignore[misc]
            if llama_tokens_per_s is not None:
                alternated.append((1000.0 / statistics.median(round_ms), llama_tokens_per_s))
        prefill_s = measure_prefill(llm, vocab_size, settings.prefill_len, settings.repeat)
        (weights,) = llm.collective_rpc(resident_weight_bytes)
        (dtypes,) = llm.collective_rpc(model_dtype)
    finally:
        llm.shutdown()
    return KvflowResult(decode_ms, prefill_s, weights, dtypes, per_op, alternated)


def set_fused_decode(enabled: bool) -> Callable[[Any], bool]:
    """A `collective_rpc` callable that turns the model's fused decode layer off (or back on); it returns whether
    the model has one."""

    def switch(worker: Any) -> bool:
        model = worker.model_runner.model
        if not hasattr(model, "_bench_fused_decode"):
            model._bench_fused_decode = model.fused_decode
        model.fused_decode = model._bench_fused_decode if enabled else None
        return model._bench_fused_decode is not None

    return switch


def run_kvflow_generate(
    model_kwargs: dict[str, Any], workload: Any, max_model_len: int
) -> BatchedResult:
    """The workload through an in-process `LLM.generate`, all requests at once (after a warm-up request)."""
    from kvflow import LLM, SamplingParams

    llm = LLM(
        **model_kwargs,
        max_model_len=max_model_len,
        max_num_seqs=len(workload.prompts),
        disable_log_stats=True,
    )
    try:
        llm.generate(
            [{"prompt_token_ids": workload.prompts[0]}],
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
            use_tqdm=False,
        )
        llm.reset_prefix_cache()
        params = [
            SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
            for n in workload.output_lens
        ]
        start = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": prompt} for prompt in workload.prompts], params, use_tqdm=False
        )
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return BatchedResult("kvflow LLM.generate", elapsed, tokens)


def kvflow_serve_command(
    model_kwargs: dict[str, Any], port: int, max_model_len: int, max_num_seqs: int
) -> list[str]:
    command = [sys.executable, "-m", "kvflow", "serve", model_kwargs["model"]]
    for key, value in model_kwargs.items():
        flag = f"--{key.replace('_', '-')}"
        if key == "model" or value is False:
            continue
        command += [flag] if value is True else [flag, str(value)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    return [*command, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]


def bench_kvflow_serve(
    model_kwargs: dict[str, Any], workload: Any, max_model_len: int
) -> BatchedResult:
    """The workload as concurrent /v1/completions requests to `kvflow serve` (after a warm-up request)."""
    import httpx

    from benchmarks import serving

    port = serving.free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = kvflow_serve_command(model_kwargs, port, max_model_len, len(workload.prompts))
    env = {**os.environ, "KVFLOW_LOGGING_LEVEL": "WARNING"}
    with running_server(command, base_url, env):
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm_up = kvflow_completion_payload(model, workload.prompts[0], 4)
        httpx.post(base_url + "/v1/completions", json=warm_up, timeout=600).raise_for_status()
        payloads = [
            kvflow_completion_payload(model, prompt, output_len)
            for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True)
        ]
        elapsed, tokens = drive_http(base_url + "/v1/completions", payloads, kvflow_output_tokens)
    return BatchedResult("kvflow serve", elapsed, tokens, shlex.join(command))
