"""Speculative decoding with structured outputs: drafts are cut to the prefix the request's grammar allows before
they are scheduled, and the step's bitmask has one row per verification row (the grammar advanced along the
drafts), so constrained greedy output is token-identical to decoding without speculation, for both backends, and
drafts are accepted. Under async scheduling a constrained request verifies only drafts the scheduler knows (none
while a step of it is in flight): its output is unchanged too."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from kvflow import LLM, SamplingParams, StructuredOutputsParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}
# Twelve syllables: the built-in model picks among three and repeats itself, so n-gram drafts apply, and each
# verification row's mask differs (after "l", only vowels; after a syllable, only a space).
PATTERN = r"((la|lo|le) ){12}"
PROMPTS = [
    "The sum is (1 + 1 + 1 + 1 + 1",
    "x = (3 + 3 + 3 + 3 + 3 + 3) and y = ",
    "Once upon a time",
]
ENGINE = {"max_model_len": 256, "max_num_seqs": 4}


@pytest.fixture(
    scope="module",
    # (guidance: the same scheduler and bitmask path through the other matcher, slow-marked for time)
    params=["xgrammar", pytest.param("guidance", marks=pytest.mark.slow)],
)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def plain(backend: str) -> Iterator[LLM]:
    llm = LLM(**ENGINE, structured_outputs_config={"backend": backend})
    yield llm
    llm.shutdown()


def texts_and_ids(llm: LLM, params: SamplingParams) -> list[tuple[str, list[int]]]:
    return [
        (output.outputs[0].text, list(output.outputs[0].token_ids))
        for output in llm.generate(PROMPTS, params, use_tqdm=False)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_greedy_output_is_token_identical(
    plain: LLM, backend: str, async_scheduling: bool
) -> None:
    llm = LLM(
        **ENGINE,
        async_scheduling=async_scheduling,
        structured_outputs_config={"backend": backend},
        speculative_config=NGRAM,
    )
    try:
        params = SamplingParams(
            temperature=0,
            max_tokens=48,
            structured_outputs=StructuredOutputsParams(regex=PATTERN),
        )
        got = texts_and_ids(llm, params)
        assert got == texts_and_ids(plain, params)
        for text, _ in got:
            assert re.fullmatch(PATTERN, text), text
        stats = llm.engine_core_client.run(lambda core: core.scheduler.make_stats()).result()
        if not async_scheduling:
            assert stats.spec_decoding_stats.num_accepted_tokens > 0
        # An unconstrained request in the same engine speculates as before.
        free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        assert texts_and_ids(llm, free) == texts_and_ids(plain, free)
    finally:
        llm.shutdown()
