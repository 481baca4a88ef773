"""Microbenchmark of the quantized-weight kernels (kvflow/kernels/quant.py, csrc/quant_*.cpp).

For each weight type and shape: M = 1 decode GEMV in GB/s of weight bytes against a plain memory read of the
same bytes (the kernel's ceiling), and for larger M the three C++ products side by side: the block GEMV, the tiled
kernel, and C++ dequantization + torch's fp32 GEMM, as same-run ratios (the machine may be noisy). Several
copies of each weight are rotated so that they do not sit in the last-level cache.

    .venv/bin/python benchmarks/quant_kernels.py [--types Q4_K int8] [--rows 1 16 64 512] [--threads 2]

With AVX-512 VNNI kernels, `w8a8` is the per-row int8 activation product (int8, Q8_0 above their float rows);
int8 then has no tiled kernel (int8_linear above its GEMV rows is the W8A8 one).

`--baseline REV` instead compares the M = 1 GEMV of the working tree's kernels with those of git revision REV
(its csrc built into the kernel cache dir, both loaded in this process), on 1 and 2 threads, measurements of the
two builds and thread counts interleaved round by round: G weights/s and GB/s of weight bytes of the fastest and
the median call, a plain memory read of the same bytes, new / old, and each build's 2-thread / 1-thread speed-up.

    .venv/bin/python benchmarks/quant_kernels.py --baseline 7010c1b --types Q4_0 Q4_K Q6_K Q8_0 int8

and, for the other `--rows`, the block product at M rows (the integer kernel for Q4_0 / Q4_K / Q6_K at every M),
new and old alternated on `--threads`:

    .venv/bin/python benchmarks/quant_kernels.py --baseline 4762b49 --types Q4_K Q6_K --rows 8 64 512

2-thread scaling of the Q8_0 / int8 GEMV (this 2-core EPYC while another benchmark ran 2 busy threads): fastest
calls 1.54-2.05x the 1-thread ones (the row bands split evenly; the kernel scales when it has both cores), medians
0.15-0.3x, and the same for a plain memory read (stream_read: median 0.06-0.2x): an OpenMP region ends when its
last thread does, and the pool worker, having spun (libgomp's default wait policy) through its share of the cores,
is often descheduled when the next region starts, so the call waits ~8 ms (two scheduler ticks). With
OMP_WAIT_POLICY=passive in the environment the medians were 0.6-1.0x (never that stall), on a quiet machine the
spinning worker is what makes back-to-back regions cheap: a process setting, not a kernel one.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.kernels import load_cpu_kernels
from kvflow.kernels.build import _CFLAGS, _LDFLAGS, kernels_build_dir
from kvflow.kernels.quant import _GGML_TYPE_CODES, INTEGER_PRODUCT_TYPES, int8_quantize
from kvflow.models.quantization.ggml_quantize import quantize

SHAPES = ((2048, 8192), (8192, 2048))  # (K, N): a gate/up-like and a down-like projection
ROTATION_BYTES = 160 * 2**20  # weights rotated per measurement: well past the last-level cache


def _best_seconds(fn, copies: int, repeat: int) -> float:
    """Best mean time of one call over `repeat` rounds, each round calling fn(i) on every copy once."""
    fn(0)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for index in range(copies):
            fn(index)
        best = min(best, (time.perf_counter() - started) / copies)
    return best


def _weights(qtype: str, K: int, N: int) -> list:
    """Copies of one random weight (as blocks, or int8 quants and scales) totalling about ROTATION_BYTES."""
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((N, K)).astype(np.float32)
    if qtype == "int8":
        packed = int8_quantize(torch.from_numpy(dense))
        size = packed[0].numel()
    else:
        packed = torch.from_numpy(quantize(qtype, dense))
        size = packed.numel()
    copies = max(1, ROTATION_BYTES // size)
    if qtype == "int8":
        return [(packed[0].clone(), packed[1].clone()) for _ in range(copies)]
    return [packed.clone() for _ in range(copies)]


def _products(ops, qtype: str, weights: list):
    """(gemv, tiled or None, dequantize + F.linear, w8a8 or None) as fn(x, i) over weight copy i. w8a8: the
    per-row int8 activation product (int8, Q8_0 on AVX-512 VNNI builds); there int8_linear above its GEMV
    rows is that product, so int8 has no tiled kernel to time."""
    w8a8 = None
    tiled = None
    if qtype == "int8":

        def run(x, i, gemv_max_rows):
            return ops.int8_linear(x, weights[i][0], weights[i][1], None, gemv_max_rows)

        def dense(x, i):
            return F.linear(x, weights[i][0].float() * weights[i][1][:, None])

        if ops.has_w8a8_kernels():
            w8a8 = functools.partial(run, gemv_max_rows=0)
        else:
            tiled = functools.partial(run, gemv_max_rows=0)
    else:
        code = _GGML_TYPE_CODES[qtype]

        def run(x, i, gemv_max_rows):
            return ops.ggml_linear(x, weights[i], code, None, gemv_max_rows)

        def dense(x, i):
            return F.linear(x, ops.ggml_dequantize(weights[i], code))

        if qtype == "Q8_0" and ops.has_w8a8_kernels():

            def w8a8(x, i):
                return ops.ggml_linear_w8a8(x, weights[i], code, None)

        tiled = functools.partial(run, gemv_max_rows=0)
    return functools.partial(run, gemv_max_rows=1 << 30), tiled, dense, w8a8


def _baseline_kernels(revision: str):
    """The CPU kernels of git `revision` (its kvflow/kernels/csrc), built once into the kernel cache dir."""
    from torch.utils.cpp_extension import load

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout

    commit = git("rev-parse", revision).strip()
    build_dir = kernels_build_dir() / f"baseline_{commit[:12]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = []
    for name in git("ls-tree", "--name-only", commit, "kvflow/kernels/csrc/").split():
        path = build_dir / Path(name).name
        path.write_text(git("show", f"{commit}:{name}"))
        if path.suffix == ".cpp":
            sources.append(str(path))
    return load(
        name=f"kvflow_baseline_{commit[:12]}",
        sources=sources,
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
    )


def _call_seconds(fn, count: int) -> list[float]:
    """Seconds of each of `count` calls fn(i) (i over the weight copies)."""
    seconds = []
    for index in range(count):
        started = time.perf_counter()
        fn(index)
        seconds.append(time.perf_counter() - started)
    return seconds


def compare_gemv(ops, baseline, types: list[str], repeat: int) -> None:
    """M = 1 GEMV of `ops` (new) and `baseline` (old) on 1 and 2 threads, interleaved round by round. Per call
    (each on the next weight copy, from memory): the fastest call (the kernel when it has the cores) and the
    median (what the machine gives now: on a shared machine a 2-thread call that waits for a descheduled thread
    takes a scheduler slice)."""
    print(
        f"M=1 GEMV, new (working tree) vs old (baseline): fastest / median call over {repeat} rounds"
    )
    for K, N in SHAPES:
        for qtype in types:
            weights = _weights(qtype, K, N)
            weight_bytes = (weights[0][0] if qtype == "int8" else weights[0]).numel()
            flat = [(w[0] if qtype == "int8" else w).view(-1).view(torch.uint8) for w in weights]
            x = torch.randn(1, K)
            gemvs = {
                "new": functools.partial(_products(ops, qtype, weights)[0], x),
                "old": functools.partial(_baseline_gemv(baseline, qtype, weights), x),
                "read": lambda i, flat=flat: ops.stream_read(flat[i]),
            }
            calls: dict[tuple[str, int], list[float]] = {}
            for _ in range(repeat):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for name, gemv in gemvs.items():
                        gemv(0)
                        seconds = _call_seconds(gemv, len(weights))
                        calls.setdefault((name, threads), []).extend(seconds)
            fastest = {key: min(seconds) for key, seconds in calls.items()}
            median = {key: float(np.median(seconds)) for key, seconds in calls.items()}
            for threads in (1, 2):
                line = f"{qtype:5s} K={K:5d} N={N:5d} t={threads}"
                for name in ("new", "old"):
                    best, typical = fastest[(name, threads)], median[(name, threads)]
                    line += (
                        f"  {name} {K * N / best / 1e9:5.1f} G/s {weight_bytes / best / 1e9:5.1f} GB/s"
                        f" (median {weight_bytes / typical / 1e9:5.1f})"
                    )
                line += f"  read {weight_bytes / fastest[('read', threads)] / 1e9:5.1f} GB/s"
                line += f"  new/old {fastest[('old', threads)] / fastest[('new', threads)]:4.2f}x"
                if threads == 2:
                    line += "  2t/1t " + " ".join(
                        f"{name} {fastest[(name, 1)] / fastest[(name, 2)]:4.2f}x"
                        f" (median {median[(name, 1)] / median[(name, 2)]:4.2f}x)"
                        for name in gemvs
                    )
                print(line, flush=True)


def _baseline_gemv(baseline, qtype: str, weights: list):
    """The baseline build's block GEMV at any M (older builds lack the W8A8 entry points)."""
    if qtype == "int8":
        return lambda x, i: baseline.int8_linear(x, weights[i][0], weights[i][1], None, 1 << 30)
    code = _GGML_TYPE_CODES[qtype]
    return lambda x, i: baseline.ggml_linear(x, weights[i], code, None, 1 << 30)


def compare_products(ops, baseline, types: list[str], rows: list[int], repeat: int) -> None:
    """The block product at M > 1 rows (the integer kernel at every M for Q4_0 / Q4_K / Q6_K: what prefill and
    batches run) of `ops` (new) and `baseline` (old), 2-thread calls alternated round by round: fastest call of
    each, G multiply-adds/s, new / old."""
    print(
        f"M>1 block product, new (working tree) vs old (baseline): fastest call over {repeat} rounds"
    )
    for K, N in SHAPES:
        for qtype in types:
            weights = _weights(qtype, K, N)[:1]
            new, old = _products(ops, qtype, weights)[0], _baseline_gemv(baseline, qtype, weights)
            for M in rows:
                x = torch.randn(M, K)
                best = {"new": float("inf"), "old": float("inf")}
                for _ in range(repeat):
                    for name, product in (("new", new), ("old", old)):
                        product(x, 0)
                        started = time.perf_counter()
                        product(x, 0)
                        best[name] = min(best[name], time.perf_counter() - started)
                print(
                    f"{qtype:5s} K={K:5d} N={N:5d} M={M:4d}  new {best['new'] * 1e3:8.2f} ms"
                    f" ({M * K * N / best['new'] / 1e9:5.0f} G/s)  old {best['old'] * 1e3:8.2f} ms"
                    f"  new/old {best['old'] / best['new']:4.2f}x",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K", "Q6_K", "int8"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16, 64, 512])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="compare with revision REV: the M=1 GEMV (rows 1), the block product at the other --rows",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_kernels()
    if ops is None:
        raise SystemExit("the CPU kernels are not available")
    if args.baseline:
        baseline = _baseline_kernels(args.baseline)
        if 1 in args.rows:
            compare_gemv(ops, baseline, args.types, args.repeat)
        if any(M > 1 for M in args.rows):
            larger = [M for M in args.rows if M > 1]
            torch.set_num_threads(args.threads)
            compare_products(ops, baseline, args.types, larger, args.repeat)
        return
    print(f"threads={args.threads}")
    for K, N in SHAPES:
        for qtype in args.types:
            weights = _weights(qtype, K, N)
            weight_bytes = (weights[0][0] if qtype == "int8" else weights[0]).numel()
            flat = [(w[0] if qtype == "int8" else w).view(-1).view(torch.uint8) for w in weights]
            read = _best_seconds(
                lambda i, flat=flat: ops.stream_read(flat[i]), len(flat), args.repeat
            )
            gemv, tiled, dense, w8a8 = _products(ops, qtype, weights)
            integer = qtype in INTEGER_PRODUCT_TYPES  # the block product at every M
            for M in args.rows:
                x = torch.randn(M, K)
                copies = len(weights) if M <= 64 else 1
                line = f"{qtype:5s} K={K:5d} N={N:5d} M={M:4d}"
                products = {"gemv": gemv} if M <= 64 or integer else {}
                if M > 1:
                    if tiled is not None:
                        products["tiled"] = tiled
                    products["dequant+torch"] = dense
                    if w8a8 is not None:
                        products["w8a8"] = w8a8
                times = {
                    name: _best_seconds(functools.partial(product, x), copies, args.repeat)
                    for name, product in products.items()
                }
                if M == 1:
                    rate = weight_bytes / times["gemv"] / 1e9
                    line += (
                        f"  gemv {times['gemv'] * 1e3:7.3f} ms = {rate:5.1f} GB/s"
                        f" (memory read {weight_bytes / read / 1e9:5.1f} GB/s, {rate * read * 1e9 / weight_bytes:.0%})"
                    )
                else:
                    reference = times["dequant+torch"]
                    line += "".join(
                        f"  {name} {seconds * 1e3:8.2f} ms ({reference / seconds:4.2f}x)"
                        for name, seconds in times.items()
                    )
                print(line, flush=True)


if __name__ == "__main__":
    main()
