"""Quantized weights: kvflow on GGUF files (and weight-only int8) against llama.cpp on the same files, same run.

Reproduce with `python benchmarks/quantized.py` (45-60 minutes on 2 cores, most of it the batched runs; `--quick`
for a smoke run of a minute on a tiny shape; `--skip-single` / `--skip-batched` / `--skip-generate` run parts).
Needs llama.cpp's tools: `tools/build_llama_cpp.sh llama-bench llama-quantize llama-server` (binaries in
`.cache/llama.cpp/bin`, `--llama-cpp-bin` for another folder; llama-server only for the batched workload, so
`--skip-batched` runs without it); `--skip-llama-cpp` runs the kvflow side alone (the quantized files must then
exist already, or only int8 / BF16 be asked for).

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
   `--alternate N` adds N rounds of one kvflow decode timing and, right after it, llama-bench's tg alone
   (`-p 0 -r 1`, kvflow's model loaded and idle): the host's memory bandwidth moves by tens of percent between
   runs and within one, so the row "N alternated rounds" (the median of each round's ratio) is the steadier
   comparison.
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
import json
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# The parts live in sibling modules; this script's namespace re-exports them (tests use `benchmarks.quantized`).
from benchmarks.quantized_checkpoint import (
    ALL_FORMATS,
    CHECKPOINT_MARKER,
    CONVERTER,
    CPU_FLAGS,
    DEFAULT_CACHE_DIR,
    DEFAULT_FORMATS,
    DEFAULT_LLAMA_CPP_BIN,
    INITIALIZER_RANGE,
    INT8_REFERENCE_FORMAT,
    LLAMA3_ROPE_SCALING,
    LLAMA_32_1B_SHAPE,
    NUM_SPECIAL_TOKENS,
    QUANTIZED_FORMATS,
    QUICK_SHAPE,
    REPO,
    SERVER_START_TIMEOUT_S,
    Settings,
    bytes_to_unicode,
    checkpoint_config,
    convert_checkpoint,
    cpu_description,
    decode_bytes_per_token,
    ensure_checkpoint,
    ensure_gguf_files,
    gguf_file_name,
    gguf_tensor_bytes,
    int8_bytes_per_token,
    llama_cpp_format,
    parse_formats,
    rope_base_note,
    run_logged,
    shape_key,
    synthetic_tokenizer,
)
from benchmarks.quantized_report import (
    FormatReport,
    markdown_table,
    print_format,
)
from benchmarks.quantized_runs import (
    BatchedResult,
    KvflowResult,
    LlamaBenchResult,
    bench_kvflow_serve,
    bench_llama_server,
    drive_http,
    finite_top_logprobs,
    kvflow_completion_payload,
    kvflow_model_kwargs,
    kvflow_output_tokens,
    kvflow_serve_command,
    llama_bench_command,
    llama_completion_payload,
    llama_decode_only,
    llama_output_tokens,
    llama_server_command,
    measure_prefill,
    model_dtype,
    parse_llama_bench,
    resident_weight_bytes,
    run_kvflow_generate,
    run_kvflow_single,
    run_llama_bench,
    running_server,
    set_fused_decode,
)

COMMAND = "python benchmarks/quantized.py"

__all__ = [
    "ALL_FORMATS",
    "CHECKPOINT_MARKER",
    "CONVERTER",
    "CPU_FLAGS",
    "DEFAULT_CACHE_DIR",
    "DEFAULT_FORMATS",
    "DEFAULT_LLAMA_CPP_BIN",
    "INITIALIZER_RANGE",
    "INT8_REFERENCE_FORMAT",
    "LLAMA3_ROPE_SCALING",
    "LLAMA_32_1B_SHAPE",
    "NUM_SPECIAL_TOKENS",
    "QUANTIZED_FORMATS",
    "QUICK_SHAPE",
    "REPO",
    "SERVER_START_TIMEOUT_S",
    "BatchedResult",
    "FormatReport",
    "KvflowResult",
    "LlamaBenchResult",
    "Settings",
    "bench_kvflow_serve",
    "bench_llama_server",
    "bytes_to_unicode",
    "checkpoint_config",
    "convert_checkpoint",
    "cpu_description",
    "decode_bytes_per_token",
    "drive_http",
    "ensure_checkpoint",
    "ensure_gguf_files",
    "finite_top_logprobs",
    "gguf_file_name",
    "gguf_tensor_bytes",
    "int8_bytes_per_token",
    "kvflow_completion_payload",
    "kvflow_model_kwargs",
    "kvflow_output_tokens",
    "kvflow_serve_command",
    "llama_bench_command",
    "llama_completion_payload",
    "llama_cpp_format",
    "llama_decode_only",
    "llama_output_tokens",
    "llama_server_command",
    "main",
    "markdown_table",
    "measure_prefill",
    "model_dtype",
    "parse_formats",
    "parse_llama_bench",
    "print_format",
    "resident_weight_bytes",
    "rope_base_note",
    "run_kvflow_generate",
    "run_kvflow_single",
    "run_llama_bench",
    "run_logged",
    "running_server",
    "set_fused_decode",
    "shape_key",
    "synthetic_tokenizer",
]


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
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="then N rounds of kvflow decode and llama-bench tg alone, one right after the other (default 0)",
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
    bench, quantize = (_llama_binary(args, name) for name in ("llama-bench", "llama-quantize"))
    # llama-server serves only the batched workload: --skip-batched runs without it.
    server = None if args.skip_batched else _llama_binary(args, "llama-server")
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
                alternate_with = (
                    llama_decode_only(bench, reference_file, threads, settings.output_len)
                    if args.alternate and bench is not None and reference_file is not None
                    else None
                )
                report.kvflow = run_kvflow_single(
                    kvflow_model_kwargs(fmt, files, checkpoint),
                    settings,
                    shape["vocab_size"],
                    alternate_with,
                    args.alternate,
                )
            except Exception as error:  # report and go on: the other formats still measure
                report.kvflow_error = f"{type(error).__name__}: {error}"
                _stderr(f"kvflow {fmt} failed: {report.kvflow_error}")
        reports.append(report)
        print_format(report, bandwidth, settings)

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


if __name__ == "__main__":
    main()
