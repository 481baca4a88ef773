"""Beam search over an engine that returns logprobs (vLLM's algorithm), written once for every driver.

Each step sends every live beam as a one-token request asking for `2 * beam_width` logprobs; every beam is
expanded by those tokens, a beam that ends with EOS (unless `ignore_eos`) is retired to the prompt's completed
list, and the best `beam_width` candidates by length-penalised score live on. After `max_tokens` steps (or when
no beam is left) the completed beams plus the live ones are ranked by the same score. Beams share their prefix, so
each step reads the prefix cache and computes only the tokens past the last full block of each beam.

`BeamSearchState` is the algorithm between steps; a driver only runs the steps. `beam_search` drives it with a
synchronous step function (`LLM.beam_search`); `AsyncLLM.beam_search` runs each step's requests concurrently:

    state = BeamSearchState(prompts, params, eos_token_id)
    while not state.finished:
        state.advance(run_one_token_requests(state.requests(), state.step_params))
    outputs = state.results(tokenizer)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.outputs import Logprob, RequestOutput
    from kvflow.sampling_params import BeamSearchParams
    from kvflow.tokenizer import Tokenizer

# Generates one token for each of `prompts` (token-id lists) with `num_logprobs` logprobs at `temperature`.
StepFn = Callable[[list[list[int]], int, float], "list[RequestOutput]"]

# The finish reasons of a step request that ended without its token (aborted, or failed in the engine).
_INTERRUPTED = ("abort", "error")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's followed by the beam's (vLLM's layout), `logprobs` one dict per
    generated token (the candidates it was chosen among), `cum_logprob` the sum of the chosen tokens' logprobs,
    `text` the decoded generated tokens (None without a tokenizer), `finish_reason` "stop" (EOS), "length", or
    the finish reason of the step that interrupted the search ("abort", "error")."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` sequences, best first; `num_cached_tokens` is how many of its prompt tokens the
    first step read from the prefix cache."""

    sequences: list[BeamSearchSequence]
    num_cached_tokens: int = 0


def get_beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's ranking: `cum_logprob / len ** length_penalty`, where len counts every token (prompt included) but a
    final EOS."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length**length_penalty)


def step_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """The SamplingParams of every step request: one token, with `2 * beam_width` logprobs, at `temperature`
    (the sampled token joins the candidates); only the final output is needed."""
    return SamplingParams(
        max_tokens=1,
        logprobs=2 * params.beam_width,
        temperature=params.temperature,
        ignore_eos=True,
        output_kind="final_only",
    )


class BeamSearchState:
    """The beam search of a batch of prompts between two steps.

    A step is one one-token request per beam of `requests()` (prompt by prompt, beam by beam), run with
    `step_params`; `advance` takes their outputs in that order. `stop(reason)` ends the search early (an abort).

    Invariants: `live[p]` holds at most `beam_width` beams of prompt p, best first, none ended by EOS (unless
    `ignore_eos`); `completed[p]` holds prompt p's beams that EOS ended; every beam starts with its prompt's
    tokens; `num_steps <= max_tokens`; once `finished`, `requests()` is not run again and `results` ranks what
    there is.
    """

    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_id: int | None
    ) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.prompts = [list(prompt) for prompt in prompts]
        self.live: list[list[BeamSearchSequence]] = [
            [BeamSearchSequence(list(prompt))] for prompt in prompts
        ]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.num_cached_tokens = [0] * len(prompts)
        self.num_steps = 0
        self.stopped: str | None = None  # the finish reason that ended the search early
        self.step_params = step_sampling_params(params)

    @property
    def finished(self) -> bool:
        return (
            self.stopped is not None
            or self.num_steps >= self.params.max_tokens
            or not any(self.live)
        )

    def requests(self) -> list[list[int]]:
        """The token ids of every live beam, prompt by prompt: the prompts of the next step's requests."""
        return [beam.tokens for prompt_beams in self.live for beam in prompt_beams]

    def stop(self, finish_reason: str = "abort") -> None:
        """End the search before its last step: its live beams finish with `finish_reason`."""
        self.stopped = finish_reason

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Expand every live beam by its step output's logprobs and keep the best `beam_width` per prompt. A step
        whose request was aborted or failed (no token) ends the search with that finish reason instead."""
        if len(outputs) != sum(map(len, self.live)):
            raise ValueError(f"a beam step needs one output per live beam, got {len(outputs)}")
        interrupted = _interrupted(outputs)
        if interrupted is not None:
            self.stop(interrupted)
            return
        remaining = iter(outputs)
        for index, prompt_beams in enumerate(self.live):
            candidates: list[BeamSearchSequence] = []
            for beam in prompt_beams:
                output = next(remaining)
                if self.num_steps == 0 and output.metrics is not None:
                    self.num_cached_tokens[index] = output.metrics.num_cached_tokens
                candidates += self._expand(index, beam, output)
            self.live[index] = sorted(candidates, key=self._score, reverse=True)[
                : self.params.beam_width
            ]
        self.num_steps += 1

    def results(self, tokenizer: Tokenizer | None = None) -> list[BeamSearchOutput]:
        """Each prompt's best `beam_width` beams among the completed and live ones, best first, with their text
        (EOS left out unless `include_stop_str_in_output`) when there is a tokenizer."""
        results: list[BeamSearchOutput] = []
        for index, prompt in enumerate(self.prompts):
            for beam in self.live[index]:
                beam.finish_reason = self.stopped or "length"
            ranked = sorted(self.completed[index] + self.live[index], key=self._score, reverse=True)
            best = ranked[: self.params.beam_width]
            if tokenizer is not None:
                for beam in best:
                    beam.text = beam_text(beam, len(prompt), tokenizer, self.params)
            results.append(BeamSearchOutput(best, self.num_cached_tokens[index]))
        return results

    def _expand(
        self, index: int, beam: BeamSearchSequence, output: RequestOutput
    ) -> list[BeamSearchSequence]:
        """`beam` extended by each candidate token of its step; those ending with EOS go to `completed[index]`."""
        step_logprobs = output.outputs[0].logprobs
        if not step_logprobs:
            raise RuntimeError("a beam step returned no logprobs")
        candidates = []
        for token_id, logprob in step_logprobs[0].items():
            candidate = BeamSearchSequence(
                [*beam.tokens, token_id],
                [*beam.logprobs, step_logprobs[0]],
                beam.cum_logprob + logprob.logprob,
            )
            if token_id == self.eos_token_id and not self.params.ignore_eos:
                candidate.finish_reason = "stop"
                self.completed[index].append(candidate)
            else:
                candidates.append(candidate)
        return candidates

    def _score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty
        )


def beam_text(
    beam: BeamSearchSequence,
    num_prompt_tokens: int,
    tokenizer: Tokenizer,
    params: BeamSearchParams,
    skip_special_tokens: bool = True,
) -> str:
    """The beam's generated tokens decoded, a final EOS left out unless `include_stop_str_in_output`."""
    generated = beam.tokens[num_prompt_tokens:]
    if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
        generated = generated[:-1]
    return tokenizer.decode(generated, skip_special_tokens=skip_special_tokens)


def _interrupted(outputs: Sequence[RequestOutput]) -> str | None:
    """The finish reason of a step output that ended without its token ("abort", "error"), if any."""
    for output in outputs:
        completion = output.outputs[0]
        if not completion.logprobs and completion.finish_reason in _INTERRUPTED:
            return completion.finish_reason
    return None


def beam_search(
    step: StepFn,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_id: int | None,
    tokenizer: Tokenizer | None = None,
) -> list[BeamSearchOutput]:
    """Run beam search for each prompt (token ids) with a synchronous `step`; see the module docstring."""
    state = BeamSearchState(prompts, params, eos_token_id)
    while not state.finished:
        state.advance(step(state.requests(), 2 * params.beam_width, params.temperature))
    return state.results(tokenizer)
