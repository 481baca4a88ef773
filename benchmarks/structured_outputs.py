"""Structured outputs' cost, same run, on the built-in default model: constrained vs unconstrained.

    python benchmarks/structured_outputs.py [--rounds 3] [--num-requests 64] [--max-tokens 128] [--quick]
    python benchmarks/structured_outputs.py --hostile [...]   (compiles beside a hostile client: see
                                                               benchmarks/hostile_constraints.py)

For each backend (xgrammar, guidance) one `LLM` (async scheduling, the default) runs, after an untimed warm-up
that also compiles the schema once:
  * throughput: `--num-requests` concurrent greedy requests of `--max-tokens` output tokens each, unconstrained
    (`ignore_eos`) and constrained by a JSON schema whose `minItems` keeps the JSON open past `--max-tokens` (so
    both sets produce the same number of tokens, in batches of the same shape), alternating for `--rounds`;
    reported: output tokens/s of each and the median ratio constrained / unconstrained;
  * time to first token of one request (`max_tokens=1`), unconstrained vs a schema compiled before (the compile
    cache): medians over 60 requests each, alternating, and their ratio;
  * the bitmask's cost: the manager's per-step fill for the batch's matchers (at mid-output states) and the
    runner's masking of those rows, per step and per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvflow import LLM, SamplingParams, StructuredOutputsParams

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

PROMPTS = ["The capital of France is", "Once upon a time", "She walked into the room and"]
# An inventory that cannot close before 40 items: the constraint stays active for every token.
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "count": {"type": "integer", "minimum": 0, "maximum": 999},
                    "kind": {"enum": ["tool", "food", "part"]},
                },
                "required": ["name", "count", "kind"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def _params(max_tokens: int, constrained: bool) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=not constrained,
        structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA) if constrained else None,
    )


def _throughput(llm: LLM, num_requests: int, max_tokens: int, constrained: bool) -> float:
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(num_requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, _params(max_tokens, constrained), use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert tokens == num_requests * max_tokens, "every request runs to max_tokens"
    return tokens / elapsed


def _ttft_s(llm: LLM, constrained: bool) -> float:
    start = time.perf_counter()
    llm.generate([PROMPTS[0]], _params(1, constrained), use_tqdm=False)
    return time.perf_counter() - start


def _bitmask_cost(llm: LLM, num_requests: int) -> dict[str, float]:
    """Per-step cost of filling `num_requests` matchers' bitmask rows (each after a few accepted tokens of the
    schema) and of masking those rows of a logits batch, in microseconds."""
    from kvflow.core.sched.output import SchedulerOutput
    from kvflow.request import Request
    from kvflow.structured_output.bitmask import apply_grammar_bitmask

    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    prefix = tokenizer.encode('{"items": [{"name": "ab', add_special_tokens=False)

    def measure(core: Any) -> dict[str, float]:
        manager = core.structured_output_manager
        requests = {}
        for i in range(num_requests):
            request = Request(f"bench{i}", [1, 2, 3], _params(16, True))
            manager.grammar_init(request)
            request.structured_output_request.compiled.result()
            request.structured_output_request.start()
            assert request.structured_output_request.grammar.accept_tokens(prefix)
            requests[request.request_id] = request
        manager._compiling.clear()
        output = SchedulerOutput.make_empty()
        output.num_scheduled_tokens = {request_id: 1 for request_id in requests}
        repeats = 50
        start = time.perf_counter()
        for _ in range(repeats):
            grammar_output = manager.grammar_bitmask(requests, output)
        fill_us = (time.perf_counter() - start) / repeats * 1e6
        vocab_size = manager.vocab_size
        logits = torch.randn(num_requests, vocab_size)
        start = time.perf_counter()
        for _ in range(repeats):
            apply_grammar_bitmask(logits, list(requests), grammar_output)
        mask_us = (time.perf_counter() - start) / repeats * 1e6
        return {
            "fill_us_per_step": fill_us,
            "fill_us_per_request": fill_us / num_requests,
            "mask_us_per_step": mask_us,
            "mask_us_per_request": mask_us / num_requests,
        }

    return llm.run_in_engine(measure)


def run_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(
        structured_outputs_config={"backend": backend},
        max_num_seqs=args.num_requests,
        disable_log_stats=True,
    )
    try:
        # Warm-up: both paths once (compiles the schema, fills caches).
        _throughput(llm, 8, 16, constrained=False)
        _throughput(llm, 8, 16, constrained=True)
        plain, constrained = [], []
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for is_constrained in order:
                rate = _throughput(llm, args.num_requests, args.max_tokens, is_constrained)
                (constrained if is_constrained else plain).append(rate)
        ttft_plain, ttft_constrained = [], []
        for index in range(4 if args.quick else 60):
            for is_constrained in (False, True) if index % 2 == 0 else (True, False):
                value = _ttft_s(llm, is_constrained)
                (ttft_constrained if is_constrained else ttft_plain).append(value)
        result = {
            "backend": backend,
            "unconstrained_tok_s": plain,
            "constrained_tok_s": constrained,
            "throughput_ratio": statistics.median(constrained) / statistics.median(plain),
            "ttft_unconstrained_ms": statistics.median(ttft_plain) * 1e3,
            "ttft_repeated_schema_ms": statistics.median(ttft_constrained) * 1e3,
        }
        result["ttft_ratio"] = result["ttft_repeated_schema_ms"] / result["ttft_unconstrained_ms"]
        result.update(_bitmask_cost(llm, args.num_requests))
        return result
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    if argv is None:
        argv = sys.argv[1:]
    if "--hostile" in argv:
        from benchmarks import (
            hostile_constraints,
        )  # the HTTP client and server helpers: only for this mode

        return [hostile_constraints.main([arg for arg in argv if arg != "--hostile"])]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--backends", default="xgrammar,guidance")
    parser.add_argument(
        "--quick", action="store_true", help="a seconds-long smoke run (1 round, 8 x 16 tokens)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.num_requests, args.max_tokens = 1, 8, 16
    results = []
    for backend in args.backends.split(","):
        result = run_backend(backend, args)
        print(json.dumps(result, indent=1))
        print(
            f"{backend}: constrained/unconstrained output tok/s "
            f"{result['throughput_ratio']:.3f} (median {statistics.median(result['constrained_tok_s']):.0f} "
            f"vs {statistics.median(result['unconstrained_tok_s']):.0f}); TTFT repeated schema "
            f"{result['ttft_repeated_schema_ms']:.1f} ms vs {result['ttft_unconstrained_ms']:.1f} ms "
            f"({result['ttft_ratio']:.3f}); bitmask fill {result['fill_us_per_step']:.0f} us/step "
            f"({result['fill_us_per_request']:.1f} us/request), masking {result['mask_us_per_step']:.0f} "
            f"us/step ({result['mask_us_per_request']:.1f} us/request)",
            flush=True,
        )
        results.append(result)
    return results


if __name__ == "__main__":
    main()
