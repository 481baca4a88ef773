"""Gemma 2 attention on the "cpu" backend: the C++ kernel with soft-capping against the earlier route (every row of
a soft-capping model attended in PyTorch), same process, same weights, same KV.

A random-weight Gemma-2-2B-shaped model (transformers' `Gemma2Config`: hidden 2304, 8 query / 4 KV heads of 256,
intermediate 9216, `query_pre_attn_scalar` 256, attention soft-cap 50, final soft-cap 30, sliding window 4096 on
even layers) with `--layers` layers (default 4: two sliding, two full) and a `--vocab` of 32000 (Gemma's 256000
would make the head, not attention, dominate a decode step), bfloat16, saved once under
`.cache/gemma-attention-bench/`. Two models load from it: **A**, `KVFLOW_CPU_ATTENTION_SOFTCAP_IN_TORCH=1` (the
route before the kernel soft-capped: SDPA cannot soft-cap, so prefill rows ran eager matmuls over a materialized
`[heads, query, keys]` float32 score tensor, decode rows batched matmuls over a gathered block table), and **B**,
the kernel. After one untimed warm-up each, they run alternately `--repeat` times (median reported):
  * **prefill**: one `--context`-token prompt in one forward (the engine's default token budget, 8192, takes it
    in one step), seconds;
  * **decode**: `--steps` decode steps right after it, single stream and `--batch` requests sharing the prompt's
    blocks (a prefix-cache hit), output tokens per second.
Figures are whole-model forwards (the same MLP and projection time on both sides), so the ratios understate the
attention kernel's own speed-up.

    .venv/bin/python benchmarks/gemma_attention.py [--context 4096] [--layers 4] [--steps 32] [--batch 8]

`--attention-only` times one attention layer alone instead (see `attention_only`), the kernel's own ratio.
`--threads 1` is the fairer A/B on a machine other work shares: OpenMP teams of 2 on an oversubscribed 2-core
machine stall at every barrier, and the torch route runs many more parallel regions per layer than the kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

# Run as a script, Python puts this folder first on sys.path: the repo root takes its place.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from kvflow.batch import BatchInputs
from kvflow.models.attention.cpu_paged import SOFTCAP_IN_TORCH_ENV
from kvflow.models.decoder_lm import DecoderForCausalLM
from kvflow.models.loader import load_model

BLOCK_SIZE = 16
CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "gemma-attention-bench"


def make_checkpoint(layers: int, vocab: int) -> Path:
    """The random bfloat16 checkpoint (made once per shape)."""
    import transformers

    path = CACHE_DIR / f"gemma2-2b-shape-{layers}l-{vocab}v"
    if (path / "config.json").exists():
        return path
    config = transformers.Gemma2Config(
        vocab_size=vocab,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=8192,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


@contextlib.contextmanager
def softcap_route(in_torch: bool) -> Iterator[None]:
    """The A/B switch, read when the attention backend is built (at model load)."""
    previous = os.environ.get(SOFTCAP_IN_TORCH_ENV)
    os.environ[SOFTCAP_IN_TORCH_ENV] = "1" if in_torch else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[SOFTCAP_IN_TORCH_ENV]
        else:
            os.environ[SOFTCAP_IN_TORCH_ENV] = previous


def make_batch(
    tables: list[list[int]], starts: list[int], query_lens: list[int], vocab: int
) -> BatchInputs:
    """One step: request r runs positions `starts[r] .. starts[r] + query_lens[r] - 1` over blocks `tables[r]`;
    the last token of each request is sampled."""
    positions, slots, query_start_loc = [], [], [0]
    for table, start, length in zip(tables, starts, query_lens, strict=True):
        for position in range(start, start + length):
            positions.append(position)
            slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        query_start_loc.append(query_start_loc[-1] + length)
    width = max(len(table) for table in tables)
    num_tokens = query_start_loc[-1]
    generator = torch.Generator().manual_seed(num_tokens)
    return BatchInputs(
        req_ids=[str(r) for r in range(len(tables))],
        block_size=BLOCK_SIZE,
        input_ids=torch.randint(3, vocab, (num_tokens,), generator=generator),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(
            [s + q for s, q in zip(starts, query_lens, strict=True)], dtype=torch.int32
        ),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.tensor(query_start_loc[1:], dtype=torch.int64) - 1,
        sampled_req_indices=torch.arange(len(tables), dtype=torch.int64),
    )


class Bench:
    """One model with its KV cache: request 0's prompt on blocks [0, prompt_blocks), and each of `batch` decode
    requests on those blocks plus its own blocks for the decoded tokens."""

    def __init__(self, model: DecoderForCausalLM, context: int, steps: int, batch: int, vocab: int):
        model.use_one_kv_group()
        self.model, self.context, self.steps, self.vocab = model, context, steps, vocab
        prompt_blocks = -(-context // BLOCK_SIZE)
        own_blocks = -(-(context + steps) // BLOCK_SIZE) - prompt_blocks + 1
        self.prompt_table = list(range(prompt_blocks))
        self.tables = [
            self.prompt_table[: context // BLOCK_SIZE]
            + list(range(prompt_blocks + r * own_blocks, prompt_blocks + (r + 1) * own_blocks))
            for r in range(batch)
        ]
        self.kv_cache = model.make_kv_cache(prompt_blocks + batch * own_blocks, BLOCK_SIZE)

    def prefill(self) -> float:
        batch = make_batch([self.prompt_table], [0], [self.context], self.vocab)
        start = time.perf_counter()
        self.model.forward(batch, self.kv_cache)
        return time.perf_counter() - start

    def decode(self, num_requests: int) -> float:
        """Output tokens per second over `steps` decode steps of `num_requests` requests at the prompt's end.
        The requests' first decode positions re-run the prompt's partial last block (block-aligned sharing)."""
        tables = self.tables[:num_requests]
        first = self.context // BLOCK_SIZE * BLOCK_SIZE
        start = time.perf_counter()
        for step in range(self.steps):
            batch = make_batch(
                tables, [first + step] * num_requests, [1] * num_requests, self.vocab
            )
            self.model.forward(batch, self.kv_cache)
        return self.steps * num_requests / (time.perf_counter() - start)


def attention_only(context: int, batch: int, repeat: int) -> None:
    """One attention layer of the Gemma-2-2B shape alone (bf16, random K/V already in a paged cache): prefill of a
    `context`-token prompt and decode at `context` for 1 and `batch` rows, A (torch route) against B (kernel),
    soft-cap 50 and no window; then a Gemma-3-like sliding layer (no soft-cap, window 1024) on the torch backend
    (SDPA over the whole block table, the cpu backend's prefill route before) against the cpu backend."""
    from kvflow.models.attention import TorchPagedAttention
    from kvflow.models.attention.cpu_paged import CpuPagedAttention

    heads, kv_heads, head_dim = 8, 4, 256
    blocks = -(-(context + 1) // BLOCK_SIZE)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(batch)]
    cache = torch.randn(2, kv_heads, batch * blocks, BLOCK_SIZE, head_dim).bfloat16()
    steps = {
        "prefill": make_batch(tables[:1], [0], [context], 32000),
        "decode_1": make_batch(tables[:1], [context], [1], 32000),
        f"decode_{batch}": make_batch(tables, [context] * batch, [1] * batch, 32000),
    }
    cases = []
    for label, in_torch in (("A torch route", True), ("B C++ kernel", False)):
        with softcap_route(in_torch):
            backend = CpuPagedAttention(
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                scale=head_dim**-0.5,
                softcap=50.0,
            )
        cases.append(("soft-cap 50, no window", label, backend, None))
    for label, backend_class in (
        ("torch backend", TorchPagedAttention),
        ("cpu backend", CpuPagedAttention),
    ):
        backend = backend_class(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5
        )
        cases.append(("window 1024, no soft-cap", label, backend, 1024))
    times: dict[tuple[str, str, str], list[float]] = {}
    with torch.inference_mode():
        # the first pass warms up (allocations, page faults), untimed
        for iteration in range(repeat + 1):
            for layer, label, backend, window in cases:
                for name, step in steps.items():
                    tokens = step.num_tokens
                    query = torch.randn(tokens, heads, head_dim).bfloat16()
                    key, value = torch.randn(2, tokens, kv_heads, head_dim).bfloat16()
                    metadata = backend.build_metadata(step, window)
                    start = time.perf_counter()
                    backend.forward(query, key, value, cache, metadata)
                    if iteration:
                        times.setdefault((layer, label, name), []).append(
                            time.perf_counter() - start
                        )
    print(
        f"\none attention layer, context {context}, bf16, {torch.get_num_threads()} threads, median of {repeat} "
        f"(load average {os.getloadavg()[0]:.2f}); ms per call"
    )
    print("| layer | step | A | B | A / B |")
    print("|---|---|---|---|---|")
    for layer, (label_a, label_b) in (
        ("soft-cap 50, no window", ("A torch route", "B C++ kernel")),
        ("window 1024, no soft-cap", ("torch backend", "cpu backend")),
    ):
        for name in steps:
            a = statistics.median(times[(layer, label_a, name)]) * 1e3
            b = statistics.median(times[(layer, label_b, name)]) * 1e3
            print(
                f"| {layer} ({label_a} / {label_b}) | {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--attention-only",
        action="store_true",
        help="time one attention layer alone, not the model",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch (and kernel) threads; 0: torch's default"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attention_only:
        attention_only(args.context, args.batch, args.repeat)
        return
    path = make_checkpoint(args.layers, args.vocab)
    benches = {}
    for label, in_torch in (("A torch route", True), ("B C++ kernel", False)):
        with softcap_route(in_torch):
            model = load_model(path, dtype="bfloat16", attention_backend="cpu")
        assert isinstance(model, DecoderForCausalLM)
        benches[label] = Bench(model, args.context, args.steps, args.batch, args.vocab)
    results: dict[str, dict[str, list[float]]] = {
        label: {"prefill_s": [], "decode_1": [], f"decode_{args.batch}": []} for label in benches
    }
    load_before = os.getloadavg()
    with torch.inference_mode():
        # warm-up (allocations, page faults, first-call paths), untimed
        for bench in benches.values():
            bench.prefill()
            bench.decode(args.batch)
        for _ in range(args.repeat):
            for label, bench in benches.items():
                results[label]["prefill_s"].append(bench.prefill())
                results[label]["decode_1"].append(bench.decode(1))
                results[label][f"decode_{args.batch}"].append(bench.decode(args.batch))
                print(label, {k: round(v[-1], 3) for k, v in results[label].items()}, flush=True)
    load_after = os.getloadavg()
    medians = {
        label: {key: statistics.median(values) for key, values in figures.items()}
        for label, figures in results.items()
    }
    a, b = medians["A torch route"], medians["B C++ kernel"]
    print(
        f"\ncontext {args.context}, {args.layers} layers, bf16, {torch.get_num_threads()} threads, "
        f"median of {args.repeat}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}"
    )
    print("| figure | A: torch route | B: C++ kernel | B / A |")
    print("|---|---|---|---|")
    print(
        f"| prefill {args.context} tokens (s, lower is better) | {a['prefill_s']:.2f} | {b['prefill_s']:.2f} | "
        f"{a['prefill_s'] / b['prefill_s']:.2f}x faster |"
    )
    for key, name in (
        ("decode_1", "decode, 1 stream"),
        (f"decode_{args.batch}", f"decode, batch {args.batch}"),
    ):
        print(f"| {name} (tok/s) | {a[key]:.1f} | {b[key]:.1f} | {b[key] / a[key]:.2f}x |")


if __name__ == "__main__":
    main()
