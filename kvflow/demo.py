"""The hash-model demo behind `kvflow demo` (and `make demo-hash`): a few hundred requests through the whole engine
on the hash model, which needs no weights or tokenizer.

Prompts share a handful of long "system prompt" prefixes, so the prefix cache matters; every output is checked
against the hash model's reference, so the demo also proves nothing was lost, duplicated or misplaced. It exits
with status 1 if any output differs. (`make demo` is something else: `kvflow generate` on the default model.)
"""

from __future__ import annotations

import argparse
import random
import time

from kvflow import LLM, SamplingParams
from kvflow.models.hash_model import reference_tokens


def build_prompts(
    num_requests: int, num_prefixes: int, prefix_len: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        rng.choice(prefixes) + [rng.randrange(1, 50000) for _ in range(rng.randrange(8, 64))]
        for _ in range(num_requests)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    prompts = build_prompts(args.num_requests, num_prefixes=8, prefix_len=192, seed=args.seed)
    llm = LLM(
        "hash",
        max_num_seqs=128,
        max_num_batched_tokens=4096,
        num_kv_blocks=4096,
        max_model_len=1024,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params)
    elapsed = time.perf_counter() - start

    num_prompt_tokens = sum(len(prompt) for prompt in prompts)
    num_output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    mismatches = sum(
        output.outputs[0].token_ids != reference_tokens(prompt, args.max_tokens)
        for output, prompt in zip(outputs, prompts, strict=True)
    )
    print(f"requests:            {len(outputs)}")
    print(f"prompt tokens:       {num_prompt_tokens}")
    print(f"output tokens:       {num_output_tokens}")
    print(f"elapsed:             {elapsed:.2f} s")
    print(
        f"throughput:          {len(outputs) / elapsed:.1f} req/s, {num_output_tokens / elapsed:.0f} output tok/s, "
        f"{(num_prompt_tokens + num_output_tokens) / elapsed:.0f} total tok/s"
    )
    print(f"prefix-cache hits:   {llm.prefix_cache_hit_rate:.1%} of prompt tokens")
    print(
        f"verified:            {len(outputs) - mismatches}/{len(outputs)} outputs equal the hash-model reference"
    )
    if mismatches:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
