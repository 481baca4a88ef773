"""Embedding throughput, finely interleaved: sentence-transformers, kvflow's `LLM.embed` with the encoder attention
kernel, and kvflow with the encoders' previous attention (PyTorch's fused attention per input, bfloat16 widened
to float32), in one process, batch by batch. For a machine shared with other work, where `embeddings.py`'s rounds
(each contender timed on every input in turn, tens of seconds apart) see the load move between contenders.

Reproduce with `python benchmarks/embeddings_ab.py --dtype auto` (and `--dtype bfloat16`, `--dtype float32`);
`--quick` is a seconds-long smoke run on tiny shapes. Same checkpoints (`--cache-dir`) and inputs as
`embeddings.py` (`--model minilm`, `--num-inputs` texts of 16-512 tokens, seeded).

The inputs are sorted longest first and cut into sentence-transformers' own batches (32), so its padding is what
encoding the whole list pads; each batch is embedded by the three contenders in an order that rotates from batch
to batch and pass to pass, and each contender's figure is inputs / its summed seconds over `--passes` passes.
`--dtype`: kvflow's (`auto`: the pooling runner's default, bfloat16 on a CPU with native bf16); sentence-transformers
runs float32 under `auto` (its default), else the same dtype. The previous attention is selected by replacing
`kvflow.models.bert.varlen_attention` with a function that declines (the layer then runs its PyTorch path) between
calls; the engine runs on a thread of this process. Printed: emb/s, the three ratios, each kvflow variant's minimum
cosine against sentence-transformers, the dtype each side ran and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import embeddings as bench

CONTENDERS = ("sentence-transformers", "kvflow kernel", "kvflow previous")
ST_BATCH = 32


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--num-inputs", type=int, default=None, help="default 300 (quick: 16)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--cache-dir", type=Path, default=bench.DEFAULT_CACHE_DIR)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import kvflow.models.bert as bert
    from kvflow import LLM

    spec = bench.MODELS["minilm"]
    overrides = bench.QUICK_OVERRIDES["minilm"] if args.quick else {}
    folder = args.cache_dir / ("minilm-quick" if args.quick else "minilm")
    path = bench.ensure_checkpoint(folder, spec, overrides)
    num_inputs = args.num_inputs or (16 if args.quick else 300)
    texts, lengths = bench.make_inputs(path, num_inputs, 16, 64 if args.quick else 512)
    st_kwargs = (
        {} if args.dtype == "auto" else {"model_kwargs": {"dtype": getattr(torch, args.dtype)}}
    )
    st_model = SentenceTransformer(str(path), device="cpu", **st_kwargs)
    llm = LLM(str(path), runner="pooling", disable_log_stats=True, dtype=args.dtype)
    kernel_attention = bert.varlen_attention

    def kvflow_run(part: list[str], kernel: bool) -> Any:
        bert.varlen_attention = kernel_attention if kernel else (lambda *_: None)
        try:
            return bench.kvflow_run(llm, part)
        finally:
            bert.varlen_attention = kernel_attention

    runs: dict[str, Callable[[list[str]], Any]] = {
        CONTENDERS[0]: lambda part: bench.st_run(st_model, part),
        CONTENDERS[1]: lambda part: kvflow_run(part, True),
        CONTENDERS[2]: lambda part: kvflow_run(part, False),
    }
    for run in runs.values():
        run(texts[: bench.WARMUP_INPUTS])
    ordered = [text for _, text in sorted(zip(lengths, texts, strict=True), key=lambda x: -x[0])]
    batches = [ordered[i : i + ST_BATCH] for i in range(0, len(ordered), ST_BATCH)]
    seconds = dict.fromkeys(runs, 0.0)
    outputs: dict[str, list[Any]] = {name: [] for name in runs}
    loads = []
    names = list(runs)
    for pass_index in range(args.passes):
        for index, batch in enumerate(batches):
            shift = (index + pass_index) % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                output = runs[name](batch)
                seconds[name] += time.perf_counter() - start
                if pass_index == 0:
                    outputs[name].append(output)
            loads.append(os.getloadavg()[0])
    rates = {name: args.passes * len(texts) / seconds[name] for name in runs}
    embeddings = {name: np.concatenate(parts) for name, parts in outputs.items()}
    held = llm.collective_rpc(bench._worker_model_dtype)[0]
    dtypes = {
        CONTENDERS[0]: bench._dtype_name(next(st_model.parameters()).dtype),
        "kvflow": bench._dtype_name(held),
    }
    summary = {
        "dtype": args.dtype,
        "dtypes": dtypes,
        "num_inputs": len(texts),
        "input_tokens": sum(lengths),
        "embeddings_per_s": rates,
        "kernel_over_st": rates[CONTENDERS[1]] / rates[CONTENDERS[0]],
        "previous_over_st": rates[CONTENDERS[2]] / rates[CONTENDERS[0]],
        "kernel_over_previous": rates[CONTENDERS[1]] / rates[CONTENDERS[2]],
        "min_cosine": {
            name: bench.min_cosine(embeddings[name], embeddings[CONTENDERS[0]])
            for name in CONTENDERS[1:]
        },
        "load": (min(loads), max(loads)),
    }
    llm.shutdown()
    print(
        f"# --dtype {args.dtype}: sentence-transformers {dtypes[CONTENDERS[0]]}, kvflow {dtypes['kvflow']}; "
        f"{len(texts)} inputs, {sum(lengths)} tokens, {args.passes} passes; "
        f"load average {summary['load'][0]:.1f}-{summary['load'][1]:.1f}"
    )
    print("emb/s: " + ", ".join(f"{name} {rate:.2f}" for name, rate in rates.items()))
    print(
        f"kernel / ST {summary['kernel_over_st']:.2f}, previous / ST {summary['previous_over_st']:.2f}, "
        f"kernel / previous {summary['kernel_over_previous']:.2f}"
    )
    print(
        "min cosine vs sentence-transformers: "
        + ", ".join(f"{name} {value:.7f}" for name, value in summary["min_cosine"].items())
    )
    return summary


if __name__ == "__main__":
    main()
