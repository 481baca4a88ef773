"""Beam search over an engine that returns logprobs (vLLM's algorithm, as `LLM.beam_search` runs it).

Each step sends every live beam as a one-token request asking for `2 * beam_width` logprobs; every beam is
expanded by those tokens, a beam that ends with EOS (unless `ignore_eos`) is retired to the prompt's completed
list, and the best `beam_width` candidates by length-penalised score live on. After `max_tokens` steps (or when
no beam is left) the completed beams plus the live ones are ranked by the same score. Beams share their prefix, so
each step reads the prefix cache and computes only the tokens past the last full block of each beam.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.outputs import Logprob, RequestOutput
    from kvflow.sampling_params import BeamSearchParams
    from kvflow.tokenizer import Tokenizer

# Generates one token for each of `prompts` (token-id lists) with `num_logprobs` logprobs at `temperature`.
StepFn = Callable[[list[list[int]], int, float], "list[RequestOutput]"]


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's followed by the beam's (vLLM's layout), `logprobs` one dict per
    generated token (the candidates it was chosen among), `cum_logprob` the sum of the chosen tokens' logprobs,
    `text` the decoded generated tokens (None without a tokenizer), `finish_reason` "stop" (EOS) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's ranking: `cum_logprob / len ** length_penalty`, where len counts every token (prompt included) but a
    final EOS."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length**length_penalty)


def beam_search(
    step: StepFn,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_id: int | None,
    tokenizer: Tokenizer | None = None,
) -> list[BeamSearchOutput]:
    """Run beam search for each prompt (token ids); see the module docstring."""
    width = params.beam_width

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(
            beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty
        )

    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(p))] for p in prompts]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [beam for prompt_beams in live for beam in prompt_beams]
        if not beams:
            break
        outputs = iter(step([beam.tokens for beam in beams], 2 * width, params.temperature))
        for index, prompt_beams in enumerate(live):
            candidates: list[BeamSearchSequence] = []
            for beam in prompt_beams:
                step_logprobs = next(outputs).outputs[0].logprobs
                assert step_logprobs, "a beam step returned no logprobs"
                for token_id, logprob in step_logprobs[0].items():
                    candidate = BeamSearchSequence(
                        [*beam.tokens, token_id],
                        [*beam.logprobs, step_logprobs[0]],
                        beam.cum_logprob + logprob.logprob,
                    )
                    if token_id == eos_token_id and not params.ignore_eos:
                        candidate.finish_reason = "stop"
                        completed[index].append(candidate)
                    else:
                        candidates.append(candidate)
            live[index] = sorted(candidates, key=score, reverse=True)[:width]
    results: list[BeamSearchOutput] = []
    for prompt, prompt_live, prompt_completed in zip(prompts, live, completed, strict=True):
        for beam in prompt_live:
            beam.finish_reason = "length"
        best = sorted(prompt_completed + prompt_live, key=score, reverse=True)[:width]
        if tokenizer is not None:
            for beam in best:
                generated = beam.tokens[len(prompt) :]
                if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                    generated = generated[:-1]
                beam.text = tokenizer.decode(generated)
        results.append(BeamSearchOutput(best))
    return results
