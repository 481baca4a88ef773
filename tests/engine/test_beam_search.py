"""`LLM.beam_search` (vLLM's algorithm) against a reference implementation of the same algorithm written here over
transformers' logits, on a tiny checkpoint transformers wrote: the same sequences, in the same order, with the same
cumulative logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow import LLM, BeamSearchParams
from kvflow.beam_search import get_beam_search_score
from kvflow.testing.hf_checkpoints import load_hf_model, make_tiny_checkpoint

EOS = 2  # the tiny checkpoints' eos_token_id


def reference_beam_search(
    model: torch.nn.Module, prompt: list[int], params: BeamSearchParams
) -> list[tuple[list[int], float]]:
    """Beam search from scratch over transformers' float32 log-softmax: each step expands every live beam by its
    top 2 * beam_width tokens, retires EOS endings, keeps the best beam_width by score; finally ranks completed
    plus live beams by the length-penalised score. Returns (tokens with the prompt, cumulative logprob), best
    first."""
    width = params.beam_width

    def score(beam: tuple[list[int], float]) -> float:
        return get_beam_search_score(beam[0], beam[1], EOS, params.length_penalty)

    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    completed: list[tuple[list[int], float]] = []
    for _ in range(params.max_tokens):
        if not live:
            break
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
            logprobs = logits.float().log_softmax(-1)
            top = logprobs.topk(2 * width)
            for logprob, token_id in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                beam = ([*tokens, token_id], cum + logprob)
                if token_id == EOS and not params.ignore_eos:
                    completed.append(beam)
                else:
                    candidates.append(beam)
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + live, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("beam"), "qwen2")


@pytest.mark.parametrize(
    "params",
    [
        BeamSearchParams(beam_width=3, max_tokens=6),
        BeamSearchParams(beam_width=4, max_tokens=5, length_penalty=0.5, ignore_eos=True),
    ],
    ids=["width3", "width4-penalty0.5-ignore-eos"],
)
def test_beam_search_matches_a_reference_over_transformers_logits(
    checkpoint: Path, params: BeamSearchParams
) -> None:
    prompts = [[5, 17, 99, 123], [7, 7, 300]]
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        num_kv_blocks=128,
        block_size=4,
    )
    try:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    model = load_hf_model(checkpoint)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference_beam_search(model, prompt, params)
        assert [beam.tokens for beam in output.sequences] == [tokens for tokens, _ in expected]
        for beam, (_, cum) in zip(output.sequences, expected, strict=True):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert beam.tokens[: len(prompt)] == prompt
            assert beam.finish_reason in ("stop", "length")


def test_bad_beam_search_params_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"BeamSearchParams\.beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match=r"BeamSearchParams\.length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    for out_of_range in (1e30, -1e30, 10.5):
        with pytest.raises(
            ValueError, match=r"BeamSearchParams\.length_penalty must be a number in \[-10, 10\]"
        ):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=out_of_range)
    for bound in (-10.0, 10):
        assert (
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=bound).length_penalty
            == bound
        )


def test_beams_read_the_prefix_cache_and_carry_their_text() -> None:
    """On the built-in model: each sequence's text is its generated tokens decoded (EOS left out), and the beams'
    shared prefixes come from the prefix cache (each step computes the tokens past the last full block only)."""
    llm = LLM(max_model_len=256, num_kv_blocks=256, block_size=4)
    try:
        prompt = "Once upon a time, in a small village by the sea, there lived"
        [output] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8))
        tokenizer = llm.get_tokenizer()
        assert tokenizer is not None
        num_prompt_tokens = len(tokenizer.encode(prompt))
        assert len(output.sequences) == 3
        for beam in output.sequences:
            generated = beam.tokens[num_prompt_tokens:]
            if beam.finish_reason == "stop":
                generated = generated[:-1]
            assert beam.text == tokenizer.decode(generated)
        scores = [
            get_beam_search_score(
                beam.tokens, beam.cum_logprob, llm.get_tokenizer().eos_token_id, 1.0
            )
            for beam in output.sequences
        ]
        assert scores == sorted(scores, reverse=True)
        assert llm.prefix_cache_hit_rate > 0.5
    finally:
        llm.shutdown()
