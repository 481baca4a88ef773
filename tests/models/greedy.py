"""Greedy decoding of a few token-id prompts through `LLM`: the comparison the quantization tests make between a
quantized model and the float model of the same weight values."""

from __future__ import annotations

from pathlib import Path

from kvflow import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 200], [1, 42, 42, 42, 300, 17, 250, 3, 99, 12, 64]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def greedy_tokens(model: Path | str, **options: object) -> list[list[int]]:
    """The first 16 greedy tokens of each of `PROMPTS` (no tokenizer), the engine shut down after."""
    llm = LLM(str(model), skip_tokenizer_init=True, disable_log_stats=True, **options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]
    finally:
        llm.shutdown()
