"""Where a forward pass's time goes on `throughput.py`'s workload, against its compute floor.

Reproduce with `python benchmarks/forward_profile.py` (`--no-floor` skips the floor measurement).

The engine runs `throughput.py`'s workload (64 requests, Qwen2-0.5B shape, bfloat16) once while recording every
batch its runner ran. The recorded passes are then replayed through `model.forward` on the same KV cache, split by
kind (decode-only passes, which the per-op layers run above the fused path's rows, and mixed passes holding a prefill
chunk): once plain (`throughput.py`'s "forward only" system), once with a wall-clock timer around each part of
the model (the linear layers' products, the LM head, attention with its K/V store, the norms, rotary, the gated
activation, the per-forward metadata and RoPE tables, the embedding, and the fused decode layers where they take a
pass); what no timer covers is the layers' Python glue and small tensor ops. With the floor, `GemmFloor` is measured
for the same passes as `throughput.py` does, and its seconds stand beside the products' measured in place, so the
gap between the forward pass and the floor splits into "products slower in place than alone" and "everything else".
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.compute_floor import GemmFloor
from benchmarks.throughput import QWEN2_05B_SHAPE, ensure_checkpoint, make_workload


def record_passes(path: Path, num_requests: int, max_num_seqs: int) -> tuple[Any, list[Any], float]:
    """The runner, every batch it ran on the workload, and the engine's seconds."""
    from kvflow import LLM, SamplingParams

    workload = make_workload(num_requests, (32, 256), (32, 128), QWEN2_05B_SHAPE["vocab_size"], 0)
    llm = LLM(
        str(path),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_num_seqs=max_num_seqs,
        max_model_len=512,
        async_scheduling=True,
    )
    runner = llm.run_in_engine(lambda core: core.executor.worker.model_runner)
    recorded: list[Any] = []
    forward = runner.model.forward

    def recording_forward(batch: Any, kv_cache: torch.Tensor) -> torch.Tensor:
        recorded.append(batch)
        return forward(batch, kv_cache)

    runner.model.forward = recording_forward
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.output_lens
    ]
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": prompt} for prompt in workload.prompts], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    runner.model.forward = forward
    return runner, recorded, elapsed


class Timers:
    """Seconds per part, summed over the wrapped calls (nested calls count in both their own part and the outer)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original = owner.__dict__[name]
        function = original.__func__ if isinstance(original, staticmethod) else original
        seconds, calls = self.seconds, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
                calls[part] += 1

        setattr(owner, name, staticmethod(timed) if isinstance(original, staticmethod) else timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def undo(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def instrument(model: Any) -> Timers:
    from kvflow.models import fused_decode
    from kvflow.models.attention.cpu_paged import CpuPagedAttention
    from kvflow.models.layers import mlp, norm, rotary, vocab
    from kvflow.models.layers.linear import Linear

    timers = Timers()
    timers.wrap(Linear, "matmul", "products (layers)")
    timers.wrap(vocab.LMHead, "forward", "LM head (+ float)")
    timers.wrap(vocab.VocabEmbedding, "forward", "embedding")
    timers.wrap(CpuPagedAttention, "forward", "attention (store + paged / SDPA)")
    timers.wrap(CpuPagedAttention, "build_metadata", "attention metadata")
    timers.wrap(norm.RMSNorm, "forward_with_residual", "add + RMSNorm")
    timers.wrap(rotary.RotaryEmbedding, "apply", "rotary")
    timers.wrap(rotary.RotaryEmbedding, "cos_sin", "RoPE tables")
    timers.wrap(fused_decode.FusedDecodeLayers, "run", "fused decode layers")
    activations = mlp._GATED_ACTIVATIONS
    original = activations["silu"]

    def silu(gate_up: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return original(gate_up)
        finally:
            timers.seconds["silu_and_mul"] += time.perf_counter() - start
            timers.calls["silu_and_mul"] += 1

    for layer in model.model.layers:
        layer.mlp.activation = silu
    timers._undo.append(
        lambda: [setattr(layer.mlp, "activation", original) for layer in model.model.layers]
    )
    return timers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=1, help="plain replays per kind (best counts)"
    )
    args = parser.parse_args(argv)
    path = ensure_checkpoint(
        Path.home() / ".cache" / "kvflow" / "bench-qwen2-0.5b-shape", QWEN2_05B_SHAPE
    )
    runner, recorded, engine_s = record_passes(path, args.num_requests, args.max_num_seqs)
    model, kv_cache = runner.model, runner.kv_cache
    kinds = {
        "decode": [b for b in recorded if b.num_tokens == b.num_reqs],
        "mixed": [b for b in recorded if b.num_tokens != b.num_reqs],
    }
    print(f"engine {engine_s:.2f} s, {len(recorded)} passes")
    floor = None
    totals = {}
    with torch.inference_mode():
        for kind, batches in kinds.items():
            plain = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for batch in batches:
                    model.forward(batch, kv_cache)
                plain = min(plain, time.perf_counter() - start)
            timers = instrument(model)
            start = time.perf_counter()
            for batch in batches:
                model.forward(batch, kv_cache)
            timed = time.perf_counter() - start
            timers.undo()
            totals[kind] = plain
            tokens = sum(b.num_tokens for b in batches)
            rows = sorted({b.num_tokens for b in batches})
            print(
                f"== {kind}: {len(batches)} passes, {tokens} tokens (rows {rows[0]}..{rows[-1]}); "
                f"forward {plain:.2f} s plain, {timed:.2f} s timed"
            )
            covered = 0.0
            for part, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
                if part != "fused decode layers":
                    covered += seconds
                print(
                    f"  {seconds:8.3f} s {100 * seconds / timed:5.1f}%  {timers.calls[part]:>6}  {part}"
                )
            print(
                f"  {timed - covered:8.3f} s {100 * (timed - covered) / timed:5.1f}%  untimed (glue)"
            )
            if not args.no_floor:
                passes = [(b.num_tokens, int(b.logits_indices.numel())) for b in batches]
                floor = GemmFloor.measure(model, passes, dtype=model.dtype)
                products = timers.seconds["products (layers)"] + timers.seconds["LM head (+ float)"]
                print(
                    f"  floor {floor.seconds:.2f} s; products in place {products:.2f} s "
                    f"({products / floor.seconds:.3f} of the floor); forward / floor {plain / floor.seconds:.3f}"
                )
    print(
        f"forward total {sum(totals.values()):.2f} s; engine / forward {engine_s / sum(totals.values()):.3f}"
    )


if __name__ == "__main__":
    main()
