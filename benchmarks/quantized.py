"""Quantized weights: kvflow on GGUF files (and weight-only int8) against llama.cpp on the same files, same run.

Reproduce with `python benchmarks/quantized.py` (45-60 minutes on 2 cores, most of it the batched runs; `--quick`
for a smoke run of a minute on a tiny shape; `--skip-single` / `--skip-batched` / `--skip-generate` run parts).
Needs llama.cpp's tools: `tools/build_llama_cpp.sh llama-bench llama-quantize llama-server` (binaries in
`.cache/llama.cpp/bin`, `--llama-cpp-bin` for another folder); `--skip-llama-cpp` runs the kvflow side alone (the
quantized files must then exist already, or only int8 / BF16 be asked for).

Checkpoint: random weights shaped like Llama-3.2-1B (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads,
head_dim 64, vocab 128256, tied embeddings, rope_theta 500000, llama3 rope scaling), every matrix a multiple of 256
wide so Q4_K applies to all of them, made by `kvflow.testing.hf_checkpoints.make_tiny_checkpoint(..., "llama",
dtype="bfloat16", initializer_range=0.02)` (the real model's init std: the helper's 0.2 is for tiny test models) with
a synthetic byte-level BPE tokenizer of exactly the vocabulary's size (every id decodes, in kvflow and in
llama-server). It is converted with `tools/convert_to_gguf.py --dtype bf16` and quantized with `llama-quantize` to
Q8_0, Q4_0 and Q4_K_M. Everything is cached under `.cache/quantized-bench/<shape>/` and reused.

Figures, one after the other in this process (only ratios within one run compare):
1. **decode** (per format): kvflow `LLM(model=FILE.gguf, tokenizer=FOLDER, max_num_seqs=1)`, one request at a time,
   a 32-token random prompt, 128 greedy tokens with `ignore_eos`, decode time only as in `latency.py` (first to last
   token, from the request's metrics; warm-up first, median of `--repeat`) against `llama-bench -p 0 -n 128 -t 2`
   (tg128). Format `int8` is kvflow's `LLM(model=FOLDER, quantization="int8")` on the bf16 checkpoint, against
   llama.cpp's Q8_0 file. Each timing alternates with the same decode with the fused decode layer turned off
   (every layer per op, `kvflow.models.fused_decode`): the row "fused layers vs per-op" is that same-run A/B.
2. **prefill** pp512: kvflow's time to first token of one fresh 512-token prompt (`max_tokens=1`, prefix cache
   reset), 512 / seconds, against `llama-bench -p 512 -n 0` (pp512).
3. **memory**: kvflow's resident weight bytes (every parameter and buffer of the model, each storage once; the KV
   cache is not among them) against the GGUF file's tensor bytes (`gguf.GGUFReader`).
4. **memory-bandwidth floor**: read bandwidth measured here (best `.sum()` over a large float32 tensor, torch's
   threads), and the bytes one decode token must read (every GGUF tensor but the token embedding, whose one row is
   nothing, unless it is also the LM head, as here; for int8 one byte per weight of every matrix plus a float32
   scale per row, norms in float32); each decode figure is printed as a fraction of bandwidth / bytes.
5. **batched** (Q4_K_M, `--batched-format`): `benchmarks/throughput.py`'s 64-request workload (seed 0; prompts
   32-256 tokens, outputs 32-128, `ignore_eos`, greedy) as concurrent HTTP requests with token-id prompts, through
   `kvflow serve FILE.gguf --tokenizer FOLDER` (/v1/completions) and `llama-server` (/completion, `n_predict`,
   `ignore_eos`) with `-np 16` and `-np 64` (the better one is the reference); kvflow's in-process
   `LLM.generate` beside them. Output tokens/s = useful output tokens / wall time from the first request sent to the
   last answer. llama-server's warm-up request also checks that its top log-probabilities are finite (random
   weights at the wrong scale overflow).
The markdown table at the end is what benchmarks/RESULTS.md records.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

REPO = Path(__file__).resolve().parents[1]
COMMAND = "python benchmarks/quantized.py"
CONVERTER = REPO / "tools" / "convert_to_gguf.py"
DEFAULT_LLAMA_CPP_BIN = Path(os.environ.get("LLAMA_CPP_DIR", REPO / ".cache" / "llama.cpp")) / "bin"
DEFAULT_CACHE_DIR = REPO / ".cache" / "quantized-bench"
CHECKPOINT_MARKER = "kvflow-quantized-benchmark.json"

# The real Llama-3.2-1B's config, less its trained weights.
LLAMA_32_1B_SHAPE: dict[str, int] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
}
# A smoke-run shape whose matrices are still multiples of 256 wide (Q4_K's super-block).
QUICK_SHAPE: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
}
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
NUM_SPECIAL_TOKENS = 256  # as Llama 3: the last 256 ids are special tokens
INITIALIZER_RANGE = 0.02  # the real model's init std (the helper's 0.2 overflows at this width)
QUANTIZED_FORMATS = ("Q8_0", "Q4_0", "Q4_K_M")  # made by llama-quantize from the bf16 file
ALL_FORMATS = ("BF16", *QUANTIZED_FORMATS, "int8")
DEFAULT_FORMATS = ("Q8_0", "Q4_0", "Q4_K_M", "int8")
INT8_REFERENCE_FORMAT = "Q8_0"  # llama.cpp's file that kvflow's int8 is compared with
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
SERVER_START_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Every size the run uses; `--quick` picks the small one."""

    shape: dict[str, int]
    prompt_len: int
    output_len: int
    prefill_len: int
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    bandwidth_bytes: int
    repeat: int

    @classmethod
    def for_args(cls, args: argparse.Namespace) -> Settings:
        if args.quick:
            settings = cls(QUICK_SHAPE, 16, 16, 64, 8, (8, 32), (4, 16), 256 * 2**20, 1)
        else:
            settings = cls(LLAMA_32_1B_SHAPE, 32, 128, 512, 64, (32, 256), (32, 128), 2**31, 3)
        overrides = {
            "repeat": args.repeat,
            "num_requests": args.num_requests,
            "output_len": args.output_len,
            "prefill_len": args.prefill_len,
        }
        return cls(
            **{
                **asdict(settings),
                **{key: value for key, value in overrides.items() if value is not None},
            }
        )

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_len + self.output_len, self.prefill_len + 16, 512)


def shape_key(shape: dict[str, int]) -> str:
    """The cache folder's name: every size of the shape."""
    return "llama-h{hidden_size}-i{intermediate_size}-l{num_hidden_layers}-a{num_attention_heads}-kv{num_key_value_heads}-d{head_dim}-v{vocab_size}".format(  # noqa: E501
        **shape
    )


def parse_formats(text: str) -> tuple[str, ...]:
    """`--formats`: a comma-separated subset of ALL_FORMATS (case-insensitive), in the order given."""
    by_upper = {name.upper(): name for name in ALL_FORMATS}
    formats = []
    for part in text.split(","):
        name = by_upper.get(part.strip().upper())
        if name is None:
            raise argparse.ArgumentTypeError(
                f"unknown format {part.strip()!r}; known: {', '.join(ALL_FORMATS)}"
            )
        if name not in formats:
            formats.append(name)
    if not formats:
        raise argparse.ArgumentTypeError("no format given")
    return tuple(formats)


def gguf_file_name(fmt: str) -> str:
    return f"{fmt.lower()}.gguf"


def llama_cpp_format(fmt: str) -> str:
    """The GGUF file llama.cpp runs for kvflow's format `fmt`."""
    return INT8_REFERENCE_FORMAT if fmt == "int8" else fmt


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's model name and which of CPU_FLAGS it has."""
    from benchmarks import latency

    name, flags = latency.cpu_name_and_flags()
    return name, [flag for flag in CPU_FLAGS if flag in flags]


# ------------------------------------------------------------------------------------------------ checkpoint
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (what ByteLevel pre-tokenizers emit)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters), strict=True))


def synthetic_tokenizer(vocab_size: int, num_special: int = NUM_SPECIAL_TOKENS) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json of exactly `vocab_size` ids: the 256 bytes, then every pair of bytes, then
    pair + byte merges, as many as fit; the last `num_special` ids are special tokens (<|begin_of_text|>,
    <|end_of_text|>, <|reserved_special_token_N|>), as in Llama 3."""
    num_bpe = vocab_size - num_special
    if num_bpe < 256 or num_special < 2:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for 256 bytes + specials")
    alphabet = list(bytes_to_unicode().values())
    vocab = {character: index for index, character in enumerate(alphabet)}
    merges: list[str] = []
    pairs = [(first, second) for first in alphabet for second in alphabet]
    triples = ((first + second, third) for first, second in pairs for third in alphabet)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) == num_bpe:
            break
        vocab[left + right] = len(vocab)
        merges.append(f"{left} {right}")
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{index}|>" for index in range(num_special - 2)
    ]
    added = [
        {
            "id": num_bpe + index,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, content in enumerate(specials)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def checkpoint_config(shape: dict[str, int]) -> dict[str, Any]:
    """make_tiny_checkpoint's overrides: the shape plus Llama-3.2-1B's other settings."""
    num_bpe = shape["vocab_size"] - NUM_SPECIAL_TOKENS
    return {
        **shape,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING),
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": num_bpe,
        "eos_token_id": num_bpe + 1,
        "pad_token_id": None,
    }


def ensure_checkpoint(folder: Path, shape: dict[str, int]) -> Path:
    """The random-weight bf16 checkpoint of `shape` with its synthetic tokenizer; made once (seed 0), reused."""
    config = checkpoint_config(shape)
    marker = folder / CHECKPOINT_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == config:
        return folder
    from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

    if folder.exists():
        shutil.rmtree(folder)
    for stale in folder.parent.glob("*.gguf*"):  # made from the previous checkpoint
        stale.unlink()
    make_tiny_checkpoint(folder, "llama", dtype="bfloat16", **copy.deepcopy(config))
    (folder / "tokenizer.json").write_text(json.dumps(synthetic_tokenizer(shape["vocab_size"])))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": config["max_position_embeddings"],
            }
        )
    )
    marker.write_text(json.dumps(config))
    return folder


def _run_logged(command: list[str], what: str) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({shlex.join(command)}):\n{(completed.stdout + completed.stderr)[-4000:]}"
        )
    return completed


def convert_checkpoint(checkpoint: Path, out: Path) -> str | None:
    """`tools/convert_to_gguf.py CHECKPOINT OUT --dtype bf16`. A converter that refuses the llama3 rope scaling gets a
    shadow folder without it (the same tensors, linked): decode speed does not depend on the rotary frequencies.
    Returns a note saying so, or None."""
    python = sys.executable
    command = [python, str(CONVERTER), str(checkpoint), str(out), "--dtype", "bf16"]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode == 0:
        return None
    if "rope_scaling" not in completed.stderr:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{completed.stderr[-4000:]}")
    shadow = out.parent / "checkpoint-without-rope-scaling"
    shutil.rmtree(shadow, ignore_errors=True)
    shadow.mkdir()
    for item in checkpoint.iterdir():
        if item.name != "config.json":
            (shadow / item.name).symlink_to(item.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    (shadow / "config.json").write_text(json.dumps(config, indent=2))
    command[2] = str(shadow)
    _run_logged(command, "converting the checkpoint to GGUF")
    shutil.rmtree(shadow)
    return (
        "the converter refuses llama3 rope_scaling: the GGUF files were converted without it "
        "(rotary frequencies only; the same tensors and speed)"
    )


def ensure_gguf_files(
    cache: Path, checkpoint: Path, formats: tuple[str, ...], llama_quantize: Path | None
) -> tuple[dict[str, Path], list[str]]:
    """The GGUF file of every format in `formats` (BF16 always: the source of the others), made when missing;
    without `llama_quantize` a missing quantized file is left out, with a note. Returns (format -> path, notes)."""
    notes: list[str] = []
    bf16 = cache / gguf_file_name("BF16")
    note_file = cache / "bf16.gguf.note"
    if not bf16.is_file():
        partial = bf16.with_suffix(".partial")
        note = convert_checkpoint(checkpoint, partial)
        partial.rename(bf16)
        note_file.write_text(note or "")
    if note_file.is_file() and note_file.read_text():
        notes.append(note_file.read_text())
    rope_note = rope_base_note(bf16, json.loads((checkpoint / "config.json").read_text()))
    if rope_note:
        notes.append(rope_note)
    files = {"BF16": bf16}
    for fmt in formats:
        if fmt not in QUANTIZED_FORMATS:
            continue
        path = cache / gguf_file_name(fmt)
        if not path.is_file():
            if llama_quantize is None or not llama_quantize.is_file():
                notes.append(
                    f"{path.name} is missing and llama-quantize is not at hand: {fmt} skipped"
                )
                continue
            partial = path.with_suffix(".partial")
            _run_logged([str(llama_quantize), str(bf16), str(partial), fmt], f"quantizing to {fmt}")
            partial.rename(path)
        files[fmt] = path
    return files, notes


def rope_base_note(gguf_path: Path, config: dict[str, Any]) -> str | None:
    """A note when the GGUF's rotary base is not the checkpoint's (transformers 5 writes it under
    `rope_parameters`): the files then compute other rotary angles than the folder, at the same speed."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get("llama.rope.freq_base")
    expected = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    if field is None or expected is None:
        return None
    written = float(field.parts[field.data[0]][0])
    if math.isclose(written, float(expected)):
        return None
    return (
        f"the GGUF files' llama.rope.freq_base is {written:g}, the checkpoint's rope_theta {expected:g} "
        "(tools/convert_to_gguf.py missed it): other rotary angles, the same work per token"
    )


def gguf_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor of a GGUF file, by name (`gguf.GGUFReader`)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {tensor.name: int(tensor.n_bytes) for tensor in reader.tensors}


def decode_bytes_per_token(tensor_bytes: dict[str, int]) -> int:
    """What one decode token reads of a GGUF file: every tensor, less the token embedding when it is not also the
    LM head (an untied model has an `output.weight`; the embedding's one looked-up row is negligible)."""
    total = sum(tensor_bytes.values())
    if "output.weight" in tensor_bytes:
        total -= tensor_bytes.get("token_embd.weight", 0)
    return total


def int8_bytes_per_token(shape: dict[str, int]) -> int:
    """Weight-only int8 per channel: one byte per weight of every matrix (the tied LM head included) plus a float32
    scale per output row; the norms in float32."""
    hidden, heads, kv_heads = (
        shape["hidden_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    head_dim, intermediate = shape["head_dim"], shape["intermediate_size"]
    matrices = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ] * shape["num_hidden_layers"] + [(shape["vocab_size"], hidden)]
    norms = (2 * shape["num_hidden_layers"] + 1) * hidden * 4
    return sum(rows * columns + 4 * rows for rows, columns in matrices) + norms


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
    completed = _run_logged(command, "llama-bench")
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

    @property
    def decode_tokens_per_s(self) -> float:
        return 1000.0 / statistics.median(self.decode_ms_per_token)

    @property
    def per_op_decode_tokens_per_s(self) -> float | None:
        if not self.per_op_decode_ms_per_token:
            return None
        return 1000.0 / statistics.median(self.per_op_decode_ms_per_token)

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


def run_kvflow_single(
    model_kwargs: dict[str, Any], settings: Settings, vocab_size: int
) -> KvflowResult:
    """Decode and prefill of one request at a time, and the loaded model's weight bytes."""
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
        prefill_s = measure_prefill(llm, vocab_size, settings.prefill_len, settings.repeat)
        (weights,) = llm.collective_rpc(resident_weight_bytes)
        (dtypes,) = llm.collective_rpc(model_dtype)
    finally:
        llm.shutdown()
    return KvflowResult(decode_ms, prefill_s, weights, dtypes, per_op)


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


# ------------------------------------------------------------------------------------------------ report
@dataclass
class FormatReport:
    """Every figure of one format; None where not measured, `kvflow_error` when kvflow failed."""

    fmt: str
    llama_cpp_file: str
    floor_bytes_per_token: int
    gguf_tensor_bytes: int | None
    kvflow: KvflowResult | None = None
    kvflow_error: str | None = None
    llama: LlamaBenchResult | None = None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(
    reports: list[FormatReport],
    bandwidth: float,
    prefill_len: int,
    output_len: int,
    batched: list[BatchedResult],
    batched_format: str,
) -> str:
    """The RESULTS.md table: one row per figure and format, kvflow beside llama.cpp, ratios in the same run."""
    lines = [
        "| figure | format | kvflow | llama.cpp | kvflow / llama.cpp | floor | kvflow / floor | llama.cpp / floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for report in reports:
        floor = bandwidth / report.floor_bytes_per_token
        kv_decode = report.kvflow.decode_tokens_per_s if report.kvflow else None
        ll_decode = report.llama.decode_tokens_per_s if report.llama else None
        label = (
            report.fmt
            if report.fmt == report.llama_cpp_file
            else f"{report.fmt} vs {report.llama_cpp_file}"
        )
        lines.append(
            f"| decode tg{output_len} tok/s | {label} | {_cell(kv_decode)} | {_cell(ll_decode)} | "
            f"{_cell(_ratio(kv_decode, ll_decode))} | {floor:.2f} | {_cell(_ratio(kv_decode, floor))} | "
            f"{_cell(_ratio(ll_decode, floor))} |"
        )
    for report in reports:
        per_op = report.kvflow.per_op_decode_tokens_per_s if report.kvflow else None
        if per_op is None:
            continue
        fused = report.kvflow.decode_tokens_per_s  # type: ignore[union-attr]
        lines.append(
            f"| decode tg{output_len} tok/s, fused layers vs per-op | {report.fmt} | {fused:.2f} | "
            f"{per_op:.2f} (kvflow per-op) | {_ratio(fused, per_op):.2f} | | | |"
        )
    for report in reports:
        kv_prefill = report.kvflow.prefill_tokens_per_s(prefill_len) if report.kvflow else None
        ll_prefill = report.llama.prefill_tokens_per_s if report.llama else None
        label = (
            report.fmt
            if report.fmt == report.llama_cpp_file
            else f"{report.fmt} vs {report.llama_cpp_file}"
        )
        lines.append(
            f"| prefill pp{prefill_len} tok/s | {label} | {_cell(kv_prefill, 1)} | {_cell(ll_prefill, 1)} | "
            f"{_cell(_ratio(kv_prefill, ll_prefill))} | | | |"
        )
    for report in reports:
        kv_bytes = report.kvflow.weight_bytes if report.kvflow else None
        file_bytes = report.gguf_tensor_bytes
        label = (
            report.fmt
            if report.fmt == report.llama_cpp_file
            else f"{report.fmt} vs {report.llama_cpp_file}"
        )
        lines.append(
            f"| weight GB (resident / file tensors) | {label} | "
            f"{_cell(None if kv_bytes is None else kv_bytes / 1e9, 3)} | "
            f"{_cell(None if file_bytes is None else file_bytes / 1e9, 3)} | "
            f"{_cell(_ratio(kv_bytes, file_bytes))} | | | |"
        )
    servers = [result for result in batched if result.name.startswith("llama-server")]
    best_server = max(servers, key=lambda result: result.output_tokens_per_s, default=None)
    best_tok_s = best_server.output_tokens_per_s if best_server else None
    for result in batched:
        if result in servers:
            continue
        lines.append(
            f"| batched out tok/s: {result.name} vs {best_server.name if best_server else 'llama-server'} | "
            f"{batched_format} | {result.output_tokens_per_s:.1f} | {_cell(best_tok_s, 1)} | "
            f"{_cell(_ratio(result.output_tokens_per_s, best_tok_s))} | | | |"
        )
    if not [result for result in batched if result not in servers] and best_server is not None:
        lines.append(
            f"| batched out tok/s: {best_server.name} | {batched_format} | - | {best_tok_s:.1f} | - | | | |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny shape, short runs (smoke run)")
    parser.add_argument(
        "--formats",
        type=parse_formats,
        default=DEFAULT_FORMATS,
        help=f"comma-separated, of {', '.join(ALL_FORMATS)} (default {','.join(DEFAULT_FORMATS)})",
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed repeats (default 3; quick 1)"
    )
    parser.add_argument("--skip-llama-cpp", action="store_true", help="kvflow only")
    parser.add_argument("--skip-kvflow", action="store_true", help="llama.cpp only")
    parser.add_argument("--skip-batched", action="store_true", help="no 64-request workload")
    parser.add_argument(
        "--skip-single", action="store_true", help="batched only: no decode, prefill or memory"
    )
    parser.add_argument(
        "--skip-generate",
        action="store_true",
        help="batched through kvflow serve only (no in-process LLM.generate run)",
    )
    parser.add_argument(
        "--batched-format", type=parse_formats, default=("Q4_K_M",), help="the batched run's format"
    )
    parser.add_argument(
        "--server-parallel",
        default="16,64",
        help="llama-server -np values to try; the best is the reference (default 16,64)",
    )
    parser.add_argument("--num-requests", type=int, default=None, help="batched requests (64)")
    parser.add_argument("--output-len", type=int, default=None, help="decode tokens (128)")
    parser.add_argument("--prefill-len", type=int, default=None, help="prefill prompt (512)")
    parser.add_argument("--llama-cpp-bin", type=Path, default=DEFAULT_LLAMA_CPP_BIN)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--json", type=Path, default=None, help="save every figure here")
    args = parser.parse_args(argv)
    if len(args.batched_format) != 1 or args.batched_format[0] == "int8":
        parser.error("--batched-format takes one GGUF format")
    try:
        args.server_parallel = [int(value) for value in args.server_parallel.split(",")]
    except ValueError:
        parser.error("--server-parallel takes comma-separated integers")
    return args


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _llama_binary(args: argparse.Namespace, name: str) -> Path | None:
    """The built tool, or None with --skip-llama-cpp; a missing one is an error saying how to build it."""
    if args.skip_llama_cpp:
        return None
    path = args.llama_cpp_bin / name
    if not path.is_file():
        raise SystemExit(
            f"{path} is not built: tools/build_llama_cpp.sh llama-bench llama-quantize llama-server"
        )
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    settings = Settings.for_args(args)
    import torch

    from benchmarks import compute_floor, throughput

    argv_shown = argv if argv is not None else sys.argv[1:]
    cpu_name, cpu_flags = cpu_description()
    threads = torch.get_num_threads()
    print(f"# {COMMAND} {shlex.join(argv_shown)}")
    print(
        f"# {cpu_name}; {os.cpu_count()} CPUs; flags: {' '.join(cpu_flags) or 'none of ' + ','.join(CPU_FLAGS)}; "
        f"torch {torch.__version__}, {threads} threads",
        flush=True,
    )
    bench, quantize, server = (
        _llama_binary(args, name) for name in ("llama-bench", "llama-quantize", "llama-server")
    )
    shape = settings.shape
    cache = args.cache_dir / shape_key(shape)
    _stderr(f"checkpoint and GGUF files under {cache} ...")
    checkpoint = ensure_checkpoint(cache / "checkpoint", shape)
    needed = {llama_cpp_format(fmt) for fmt in args.formats} | set(args.batched_format)
    files, notes = ensure_gguf_files(cache, checkpoint, tuple(sorted(needed)), quantize)
    print(
        f"# checkpoint {checkpoint} (bf16 random weights, init std {INITIALIZER_RANGE}); shape {shape}"
    )
    for note in notes:
        print(f"# note: {note}")

    _stderr("read bandwidth ...")
    bandwidth = compute_floor.read_bandwidth(settings.bandwidth_bytes, 5)
    print(
        f"# read bandwidth {bandwidth / 1e9:.1f} GB/s (best float32 .sum() of 5 over "
        f"{settings.bandwidth_bytes // 2**20} MiB, {threads} threads)",
        flush=True,
    )

    llama_results: dict[str, LlamaBenchResult] = {}
    reports: list[FormatReport] = []
    for fmt in () if args.skip_single else args.formats:
        reference = llama_cpp_format(fmt)
        reference_file = files.get(reference)
        if reference_file is None and fmt != "int8":
            continue  # no file (a note says why)
        tensor_bytes = None if reference_file is None else gguf_tensor_bytes(reference_file)
        if fmt == "int8" or tensor_bytes is None:
            floor_bytes = int8_bytes_per_token(shape)
        else:
            floor_bytes = decode_bytes_per_token(tensor_bytes)
        file_bytes = None if tensor_bytes is None else sum(tensor_bytes.values())
        report = FormatReport(fmt, reference, floor_bytes, file_bytes)
        if bench is not None and reference_file is not None and reference not in llama_results:
            _stderr(f"llama-bench {reference} ...")
            llama_results[reference] = run_llama_bench(
                bench,
                files[reference],
                threads,
                settings.output_len,
                settings.prefill_len,
                settings.repeat,
            )
        report.llama = llama_results.get(reference)
        if not args.skip_kvflow:
            _stderr(f"kvflow {fmt} decode and prefill ...")
            try:
                report.kvflow = run_kvflow_single(
                    kvflow_model_kwargs(fmt, files, checkpoint), settings, shape["vocab_size"]
                )
            except Exception as error:  # report and go on: the other formats still measure
                report.kvflow_error = f"{type(error).__name__}: {error}"
                _stderr(f"kvflow {fmt} failed: {report.kvflow_error}")
        reports.append(report)
        _print_format(report, bandwidth, settings)

    batched: list[BatchedResult] = []
    batched_errors: list[str] = []
    if not args.skip_batched and args.batched_format[0] in files:
        (batched_format,) = args.batched_format
        workload = throughput.make_workload(
            settings.num_requests,
            settings.prompt_range,
            settings.output_range,
            shape["vocab_size"],
            seed=0,
        )
        print(
            f"# batched: {settings.num_requests} requests, {sum(map(len, workload.prompts))} prompt tokens, "
            f"{workload.num_output_tokens} output tokens, {batched_format}",
            flush=True,
        )
        runs: list[tuple[str, Callable[[], BatchedResult]]] = []
        if not args.skip_kvflow:
            model_kwargs = kvflow_model_kwargs(batched_format, files, checkpoint)
            runs.append(
                (
                    "kvflow serve",
                    lambda: bench_kvflow_serve(model_kwargs, workload, settings.max_model_len),
                )
            )
            if not args.skip_generate:
                runs.append(
                    (
                        "kvflow LLM.generate",
                        lambda: run_kvflow_generate(model_kwargs, workload, settings.max_model_len),
                    )
                )
        if server is not None:
            for parallel in args.server_parallel:
                runs.append(
                    (
                        f"llama-server -np {parallel}",
                        lambda parallel=parallel: bench_llama_server(
                            server,
                            files[batched_format],
                            workload,
                            threads,
                            parallel,
                            settings.max_model_len,
                        ),
                    )
                )
        for name, run in runs:
            _stderr(f"batched: {name} ...")
            try:
                result = run()
            except Exception as error:  # report and go on
                batched_errors.append(f"{name}: {type(error).__name__}: {error}")
                _stderr(f"batched {name} failed: {batched_errors[-1]}")
                continue
            batched.append(result)
            print(
                f"batched {result.name:<22} {result.elapsed_s:8.2f} s {result.output_tokens_per_s:9.1f} out tok/s"
                + (f"  ({result.detail})" if result.detail else ""),
                flush=True,
            )

    table = markdown_table(
        reports,
        bandwidth,
        settings.prefill_len,
        settings.output_len,
        batched,
        args.batched_format[0],
    )
    print()
    print(table)
    for report in reports:
        if report.kvflow_error:
            print(f"kvflow {report.fmt} failed: {report.kvflow_error}")
    for error in batched_errors:
        print(f"batched {error}")

    results: dict[str, Any] = {
        "command": f"{COMMAND} {shlex.join(argv_shown)}",
        "cpu": cpu_name,
        "cpu_flags": cpu_flags,
        "torch": torch.__version__,
        "threads": threads,
        "shape": shape,
        "checkpoint": str(checkpoint),
        "files": {fmt: str(path) for fmt, path in files.items()},
        "notes": notes,
        "read_bandwidth_bytes_per_s": bandwidth,
        "settings": asdict(settings),
        "formats": [
            {
                **{
                    key: value
                    for key, value in asdict(report).items()
                    if key not in ("kvflow", "llama")
                },
                "kvflow": None if report.kvflow is None else asdict(report.kvflow),
                "llama_cpp": None if report.llama is None else asdict(report.llama),
            }
            for report in reports
        ],
        "batched": [
            {**asdict(result), "output_tokens_per_s": result.output_tokens_per_s}
            for result in batched
        ],
        "batched_errors": batched_errors,
        "table": table,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def _print_format(report: FormatReport, bandwidth: float, settings: Settings) -> None:
    """One format's figures as soon as they are measured (the table at the end repeats them)."""
    floor = bandwidth / report.floor_bytes_per_token
    parts = [
        f"{report.fmt}: floor {floor:.2f} tok/s ({report.floor_bytes_per_token / 1e9:.3f} GB/token)"
    ]
    if report.kvflow is not None:
        kv = report.kvflow
        parts.append(
            f"kvflow decode {kv.decode_tokens_per_s:.2f} tok/s ({kv.decode_tokens_per_s / floor:.2f} of floor), "
            f"pp{settings.prefill_len} {kv.prefill_tokens_per_s(settings.prefill_len):.1f} tok/s, "
            f"weights {kv.weight_bytes / 1e9:.3f} GB ({kv.model_dtype})"
        )
    if report.llama is not None and report.llama.decode_tokens_per_s is not None:
        ll = report.llama
        parts.append(
            f"llama.cpp {report.llama_cpp_file} tg{settings.output_len} {ll.decode_tokens_per_s:.2f} tok/s "
            f"({ll.decode_tokens_per_s / floor:.2f} of floor), pp{settings.prefill_len} "
            f"{_cell(ll.prefill_tokens_per_s, 1)} tok/s  [{ll.command}]"
        )
    print("; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
