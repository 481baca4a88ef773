"""Per-token engine overhead of one request decoding alone: where a decode step's time outside `model.forward` goes.

Reproduce with `python benchmarks/step_overhead.py --model FILE.gguf --tokenizer CHECKPOINT` (the workload of
`benchmarks/latency.py` and `benchmarks/quantized.py`: `LLM(..., max_num_seqs=1)`, a 32-token random prompt, 128
greedy tokens with `ignore_eos`, an untimed warm-up request first); `--model hash` runs the engine on the hash test
model, `--sync` turns async scheduling off. Every decode step of the timed requests is cut at four points on the
engine thread, from the end of one `model.forward` to the start of the next (the "gap", the per-token overhead):
  a. forward end -> `ModelRunner.execute_model` returns: sampling and the runner's state update;
  b. -> `EngineCore.step` returns: the scheduler applying the previous step's output;
  c. -> the next `EngineCore.step` starts: the engine loop (output processing, detokenization, stats, messages);
  d. -> the next `model.forward` starts: scheduling, the runner applying the plan and building the batch.
Medians over all steps; ms/token as latency.py measures it (from the request's metrics). Only same-run
comparisons mean anything: alternate the checkouts being compared.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script, Python puts this folder first on sys.path: the repo root takes its place.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.latency import measure_decode

SEGMENTS = (
    "a. forward end -> runner returns",
    "b. runner returns -> step returns",
    "c. step returns -> next step",
    "d. step starts -> forward starts",
    "gap: forward end -> next forward",
)


def _record(events: list[tuple[str, float]], obj: Any, name: str, tag: str) -> None:
    """Wrap `obj.name` to append `(tag + "<", start)` and `(tag + ">", end)` to `events`."""
    inner: Callable[..., Any] = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        events.append((tag + "<", time.perf_counter()))
        result = inner(*args, **kwargs)
        events.append((tag + ">", time.perf_counter()))
        return result

    setattr(obj, name, timed)


def split_steps(events: list[tuple[str, float]], max_gap_s: float = 0.02) -> dict[str, list[float]]:
    """Each segment's seconds per decode step, from forward (F), runner (R) and step (S) events; gaps longer than
    `max_gap_s` (between requests) are left out."""
    segments: dict[str, list[float]] = {name: [] for name in (*SEGMENTS, "forward")}
    starts = [i for i, (tag, _) in enumerate(events) if tag == "F<"]
    for first, second in itertools.pairwise(starts):
        window = events[first : second + 1]
        stamps: dict[str, float] = {}
        for tag, stamp in window:
            if tag in ("F>", "R>", "S>"):
                stamps.setdefault(tag, stamp)
            elif tag == "S<":
                stamps["S<"] = stamp  # the last step start before the next forward
        if len(stamps) < 4 or not stamps["F>"] <= stamps["R>"] <= stamps["S>"] <= stamps["S<"]:
            continue
        next_forward = window[-1][1]
        if next_forward - stamps["F>"] > max_gap_s:
            continue
        values = (
            stamps["R>"] - stamps["F>"],
            stamps["S>"] - stamps["R>"],
            stamps["S<"] - stamps["S>"],
            next_forward - stamps["S<"],
            next_forward - stamps["F>"],
        )
        for name, value in zip(SEGMENTS, values, strict=True):
            segments[name].append(value)
        segments["forward"].append(stamps["F>"] - window[0][1])
    return segments


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", required=True, help="a GGUF file or checkpoint folder, or 'hash'"
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--repeats", type=int, default=3, help="timed requests")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--sync", action="store_true", help="async_scheduling=False")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    from kvflow import LLM

    llm = LLM(
        model=args.model,
        tokenizer=args.tokenizer,
        max_num_seqs=1,
        max_model_len=4096,
        async_scheduling=not args.sync,
    )
    events: list[tuple[str, float]] = []

    def instrument(core: Any) -> int:
        runner = core.executor.worker.model_runner
        _record(events, runner.model, "forward", "F")
        _record(events, runner, "execute_model", "R")
        _record(events, core, "step", "S")
        return int(runner.model.vocab_size)

    vocab_size = llm.run_in_engine(instrument)
    measure_decode(llm, vocab_size, 32, args.output_len, 1)  # warm-up (measure_decode adds its own)
    events.clear()
    decode = measure_decode(llm, vocab_size, 32, args.output_len, args.repeats)
    segments = split_steps(events)
    mode = "sync" if args.sync else "async"
    print(f"ms/token ({mode}): {[round(value, 2) for value in decode.ms_per_token]}")
    print(f"decode steps timed: {len(segments['forward'])}")
    medians = {name: 1e6 * statistics.median(values) for name, values in segments.items() if values}
    for name, median_us in medians.items():
        print(f"  {name:<36} median {median_us:10.1f} us")
    llm.shutdown()
    return {"ms_per_token": decode.ms_per_token, "median_us": medians}


if __name__ == "__main__":
    main()
