"""Structured outputs through `LLM` on the built-in default model, which never writes JSON by itself: the
constraint does all the work. Both backends; async and sync scheduling; preemption; mixed batches."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvflow import LLM, SamplingParams, StructuredOutputsParams
from tests.entrypoints.test_structured_outputs_api import ALL_OF_SCHEMA, valid_all_of
from tests.entrypoints.test_structured_outputs_api import SCHEMA as PERSON_SCHEMA

BACKENDS = ("xgrammar", "guidance")
PROMPTS = ["The capital of France is", "Once upon a time", "She walked into the room and"]
# A schema whose compact outputs take ~20 tokens (the scheduling comparisons run many requests three times).
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# GBNF / xgrammar EBNF (llguidance converts it): a parenthesised sum of small numbers.
SUM_GRAMMAR = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
SUM_PATTERN = r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)"


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request: pytest.FixtureRequest) -> LLM:
    return LLM(structured_outputs_config={"backend": request.param})


def _texts(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[str]:
    return [
        completion.text
        for output in llm.generate(prompts, params, use_tqdm=False)
        for completion in output.outputs
    ]


def test_json_schema_outputs_parse_and_validate(llm: LLM) -> None:
    constraint = StructuredOutputsParams(json=PERSON_SCHEMA)
    greedy = SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=constraint)
    sampled = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=300, structured_outputs=constraint
    )
    texts = _texts(llm, greedy) + _texts(llm, sampled, PROMPTS[:1])
    assert len(texts) == 6
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_json_object_choice_regex_and_grammar(llm: LLM) -> None:
    def run(**constraint: object) -> list[str]:
        params = SamplingParams(
            temperature=0.8,
            seed=3,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(**constraint),  # type: ignore[arg-type]
        )
        return _texts(llm, params)

    for text in run(json_object=True):
        assert isinstance(json.loads(text), dict)
    for text in run(choice=["red", "green", "blue jeans"]):
        assert text in ("red", "green", "blue jeans")
    for text in run(regex=r"[A-Z][a-z]{2,6}-[0-9]{3}"):
        assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", text), text
    for text in run(grammar=SUM_GRAMMAR):
        assert re.fullmatch(SUM_PATTERN, text), text


def test_thousands_of_choices_within_the_limit_are_served(llm: LLM) -> None:
    """4,000 choices (under the default max_choices, 4,096) on both backends. llguidance's own "choice" grammar
    made each string a parser alternative and its parser refuses rows of more than 2,000 items, so on guidance
    every such request failed at its first token."""
    choices = [f"option {index}" for index in range(4000)]
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            assert completion.text in choices, completion.text


def test_compact_json_has_no_whitespace(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=300,
        structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True),
    )
    for text in _texts(llm, params):
        value = json.loads(text)
        assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_repeated_constraint_compiles_once(llm: LLM) -> None:
    def num_compiles() -> int:
        return llm.run_in_engine(lambda core: core.structured_output_manager.num_compiles)

    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=r"(yes|no), [a-z]{1,8}"),
    )
    _texts(llm, params)
    before = num_compiles()
    for _ in range(3):
        _texts(llm, params)
    assert num_compiles() == before


@pytest.mark.parametrize(
    "backend",
    # (the guidance run repeats the scheduling comparison through the other matcher: slow-marked for time)
    [BACKENDS[0], pytest.param(BACKENDS[1], marks=pytest.mark.slow)],
)
def test_sync_async_and_preempted_runs_agree(backend: str) -> None:
    """Greedy constrained outputs are the same tokens with async scheduling, without it, and when a small KV cache
    preempts requests in flight (each matcher then holds exactly the kept tokens)."""
    constraint = StructuredOutputsParams(json=SMALL_SCHEMA, disable_any_whitespace=True)
    prompts = [f"{prompt} {i}" for i in range(2) for prompt in PROMPTS]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            structured_outputs=constraint if i % 3 else None,
            ignore_eos=i % 3 == 0,
        )
        for i in range(len(prompts))
    ]
    runs = {}
    options = {
        "async": {"async_scheduling": True},
        "sync": {"async_scheduling": False},
        # 12 blocks of 16 tokens hold about half of what the six requests need: they preempt each other.
        "preempted": {
            "async_scheduling": True,
            "num_kv_blocks": 12,
            "block_size": 16,
            "max_model_len": 128,
        },
    }
    for name, engine_options in options.items():
        llm = LLM(structured_outputs_config={"backend": backend}, **engine_options)
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs[name] = [output.outputs[0].token_ids for output in outputs]
            if name == "preempted":
                assert sum(s.num_preemptions_total for s in llm.scheduler_stats()) > 0
            for output, request_params in zip(outputs, params, strict=True):
                if request_params.structured_outputs is not None:
                    jsonschema.validate(json.loads(output.outputs[0].text), SMALL_SCHEMA)
        finally:
            llm.shutdown()
    assert runs["async"] == runs["sync"] == runs["preempted"]


def test_mixed_batch_leaves_unconstrained_requests_bit_identical() -> None:
    """32 concurrent requests, half constrained: each unconstrained one gets its solo run's tokens, and the same
    logprobs, bit for bit, as in the same batch without any constraint. (The constraint cannot complete within
    max_tokens, so both batches keep the same shape at every step: the model's own numerics then cannot differ.)"""
    llm = LLM()
    try:
        prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(32)]
        constraint = StructuredOutputsParams(regex=r"[a-z ]{400}")

        def params(constrained: bool) -> SamplingParams:
            return SamplingParams(
                temperature=0.0,
                max_tokens=24,
                logprobs=2,
                ignore_eos=True,
                structured_outputs=constraint if constrained else None,
            )

        mixed = llm.generate(prompts, [params(i % 2 == 0) for i in range(32)], use_tqdm=False)
        plain = llm.generate(prompts, [params(False)] * 32, use_tqdm=False)
        for i in range(1, 32, 2):
            assert mixed[i].outputs[0].token_ids == plain[i].outputs[0].token_ids
            assert mixed[i].outputs[0].logprobs == plain[i].outputs[0].logprobs
        for i in range(1, 32, 8):
            solo = llm.generate([prompts[i]], params(False), use_tqdm=False)[0]
            assert solo.outputs[0].token_ids == mixed[i].outputs[0].token_ids
        for i in range(0, 32, 2):
            assert re.fullmatch(r"[a-z ]+", mixed[i].outputs[0].text)
            assert len(mixed[i].outputs[0].token_ids) == 24
    finally:
        llm.shutdown()


def test_auto_sends_a_schema_xgrammar_would_half_enforce_to_guidance() -> None:
    """`allOf` of two subschemas: xgrammar refuses it (it would enforce only one), "auto" compiles it with guidance,
    and every output holds both."""
    params = SamplingParams(
        n=3,
        temperature=0.8,
        seed=3,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(json=ALL_OF_SCHEMA),
    )
    llm = LLM(structured_outputs_config={"backend": "auto"})
    try:
        texts = _texts(llm, params, PROMPTS[:1])
    finally:
        llm.shutdown()
    assert len(texts) == 3
    for text in texts:
        valid_all_of(text)
