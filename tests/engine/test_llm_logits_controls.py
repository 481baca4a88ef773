"""Logits controls end to end: the input processor's part (vocabulary checks naming the field, prompt truncation,
bad words tokenized in both forms) and `LLM` on the built-in default model (logit_bias, allowed_token_ids,
bad_words, truncate_prompt_tokens; with n=2, and with async scheduling on and off)."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.input_processor import InputProcessor
from kvflow.engine.request_limits import RequestLimits
from kvflow.model_info import resolve_model_info

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, num_kv_blocks=512, max_num_seqs=16)


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def generate_ids(llm: LLM, prompt: object, params: SamplingParams) -> list[list[int]]:
    [output] = llm.generate(prompt, params, use_tqdm=False)  # type: ignore[arg-type]
    return [list(completion.token_ids) for completion in output.outputs]


def contains(tokens: list[int], sequence: list[int]) -> bool:
    width = len(sequence)
    return any(tokens[i : i + width] == sequence for i in range(len(tokens) - width + 1))


# ---------------------------------------------------------------------------------------------- input processor
def test_ids_outside_the_vocabulary_are_refused_naming_the_field(llm: LLM) -> None:
    vocab = llm.input_processor.vocab_size
    cases = [
        (SamplingParams(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
        (SamplingParams(logit_bias={3: 1.0, vocab: -1.0}), "logit_bias"),
    ]
    for params, name in cases:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name} holds \[{vocab}"):
            llm.input_processor.process(PROMPT, params)
        with pytest.raises(ValueError, match=name):
            llm.generate(PROMPT, params, use_tqdm=False)
    # The last id of the vocabulary is fine.
    processed = llm.input_processor.process(
        PROMPT, SamplingParams(allowed_token_ids=[vocab - 1], logit_bias={vocab - 1: 100})
    )
    assert processed.sampling_params.allowed_token_ids == [vocab - 1]


def test_the_core_checks_bad_words_token_ids_it_receives(llm: LLM) -> None:
    limits = llm.input_processor.limits
    vocab = limits.vocab_size
    limits.check_params(SamplingParams(bad_words=["a"], bad_words_token_ids=[[1], [2, 3]]))
    for bad in ([[vocab]], [[]], [[1, -1]], [1, 2], "x", [[True]]):
        params = SamplingParams()
        params.bad_words_token_ids = bad  # type: ignore[assignment]
        with pytest.raises(ValueError, match="bad_words_token_ids"):
            limits.check_params(params)


def test_bad_words_are_tokenized_plain_and_after_a_space_without_special_tokens(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(bad_words=["fox", "  lazy dog", " world", "fox"])
    processed = llm.input_processor.process(PROMPT, params)
    expected: list[list[int]] = []
    for text in ("fox", " fox", "lazy dog", " lazy dog", "world", " world"):
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        if token_ids not in expected:
            expected.append(token_ids)
    assert processed.sampling_params.bad_words_token_ids == expected
    # Both forms of "fox" differ on this tokenizer, so both are there (vLLM would drop the longer-or-shorter one).
    assert tokenizer.encode("fox", add_special_tokens=False) != tokenizer.encode(
        " fox", add_special_tokens=False
    )
    special = tokenizer.all_special_ids
    assert not any(t in special for word in expected for t in word)
    # The caller's params, which may serve several prompts, are left alone.
    assert params.bad_words_token_ids is None
    assert params.bad_words == ["fox", "  lazy dog", " world", "fox"]


def test_bad_words_token_ids_are_derived_only_from_bad_words(llm: LLM) -> None:
    params = SamplingParams()
    params.bad_words_token_ids = [[5]]
    processed = llm.input_processor.process(PROMPT, params)
    assert processed.sampling_params.bad_words_token_ids is None
    plain = SamplingParams()
    assert llm.input_processor.process(PROMPT, plain).sampling_params.bad_words_token_ids is None


def test_bad_words_need_a_tokenizer(llm: LLM) -> None:
    processor = InputProcessor(llm.model_info, None, 512)
    with pytest.raises(ValueError, match="bad_words"):
        processor.process({"prompt_token_ids": [1, 2, 3]}, SamplingParams(bad_words=["fox"]))


def test_the_hash_model_refuses_logits_controls_but_truncates() -> None:
    processor = InputProcessor(resolve_model_info("hash"), None, 64)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    for params, name in (
        (SamplingParams(allowed_token_ids=[1]), "allowed_token_ids"),
        (SamplingParams(logit_bias={1: 1.0}), "logit_bias"),
        (SamplingParams(bad_words=["a"]), "bad_words"),
    ):
        with pytest.raises(ValueError, match=name):
            processor.process(prompt, params)
    processed = processor.process(prompt, SamplingParams(truncate_prompt_tokens=2))
    assert processed.prompt_token_ids == [3, 4]


def test_truncate_prompt_tokens_keeps_the_last_k_before_the_length_check(llm: LLM) -> None:
    processor = llm.input_processor
    full = llm.get_tokenizer().encode(PROMPT)
    processed = processor.process(PROMPT, SamplingParams(truncate_prompt_tokens=5))
    assert processed.prompt_token_ids == full[-5:] and processed.prompt == PROMPT
    long_ids = [(7 * i) % 1000 + 10 for i in range(700)]  # longer than max_model_len=512
    with pytest.raises(ValueError, match="no room to generate"):
        processor.process({"prompt_token_ids": long_ids}, SamplingParams())
    processed = processor.process(
        {"prompt_token_ids": long_ids}, SamplingParams(truncate_prompt_tokens=100)
    )
    assert processed.prompt_token_ids == long_ids[-100:]
    short = processor.process(
        {"prompt_token_ids": [5, 6]}, SamplingParams(truncate_prompt_tokens=8)
    )
    assert short.prompt_token_ids == [5, 6]
    assert (
        processor.process(PROMPT, SamplingParams(truncate_prompt_tokens=-1)).prompt_token_ids
        == full
    )
    # -1 keeps the last max_model_len - 1 tokens (512 here): room for one output token.
    kept = processor.process(
        {"prompt_token_ids": long_ids}, SamplingParams(truncate_prompt_tokens=-1)
    )
    assert kept.prompt_token_ids == long_ids[-511:]


def test_request_limits_name_stop_token_ids_as_before() -> None:
    limits = RequestLimits(vocab_size=10, max_model_len=8)
    with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_ids holds \[10\]"):
        limits.check_params(SamplingParams(stop_token_ids=[3, 10]))


# ---------------------------------------------------------------------------------------------- LLM end to end
def test_logit_bias_moves_the_greedy_first_token(llm: LLM) -> None:
    [[first]] = generate_ids(llm, PROMPT, greedy(max_tokens=1))
    [[other]] = generate_ids(llm, PROMPT, greedy(max_tokens=1, logit_bias={first: -100}))
    assert other != first
    forced = llm.get_tokenizer().encode(" world", add_special_tokens=False)[0]
    assert forced != first
    [tokens] = generate_ids(llm, PROMPT, greedy(max_tokens=4, logit_bias={forced: 100}))
    assert tokens == [forced] * 4


def test_allowed_token_ids_restrict_every_output_token(llm: LLM) -> None:
    allowed = sorted(
        set(llm.get_tokenizer().encode(" a cat sat on the mat", add_special_tokens=False))
    )
    for params in (
        greedy(max_tokens=8, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, allowed_token_ids=allowed),
    ):
        outputs = generate_ids(llm, PROMPT, params)
        assert len(outputs) == params.n
        for tokens in outputs:
            assert tokens and set(tokens) <= set(allowed)


def test_bad_words_never_appear_in_the_output(llm: LLM) -> None:
    [baseline] = generate_ids(llm, PROMPT, greedy(max_tokens=12))
    text = llm.get_tokenizer().decode(baseline)
    words = [word for word in text.split() if word.strip(",.")][:2]
    params = greedy(max_tokens=12, bad_words=words)
    sequences = llm.input_processor.process(PROMPT, params).sampling_params.bad_words_token_ids
    assert sequences
    assert any(contains(baseline, sequence) for sequence in sequences)
    outputs = generate_ids(llm, PROMPT, params)
    outputs += generate_ids(
        llm,
        PROMPT,
        SamplingParams(
            temperature=0.8, seed=1, n=2, max_tokens=12, ignore_eos=True, bad_words=words
        ),
    )
    for tokens in outputs:
        assert len(tokens) == 12
        assert not any(contains(tokens, sequence) for sequence in sequences), (tokens, sequences)
    assert outputs[0] != baseline


def test_truncate_prompt_tokens_sets_the_output_prompt(llm: LLM) -> None:
    full = llm.get_tokenizer().encode(PROMPT)
    [output] = llm.generate(PROMPT, greedy(max_tokens=3, truncate_prompt_tokens=4), use_tqdm=False)
    assert output.prompt_token_ids == full[-4:]
    [by_ids] = llm.generate(
        {"prompt_token_ids": full}, greedy(max_tokens=3, truncate_prompt_tokens=4), use_tqdm=False
    )
    assert by_ids.prompt_token_ids == full[-4:]
    [reference] = llm.generate(
        {"prompt_token_ids": full[-4:]}, greedy(max_tokens=3), use_tqdm=False
    )
    assert (
        output.outputs[0].token_ids == reference.outputs[0].token_ids == by_ids.outputs[0].token_ids
    )


def all_controls(the: int, first: int, comma: int) -> list[SamplingParams]:
    """A batch mixing every control with plain requests, greedy and seeded (ids of " the", " first", ",")."""
    base: dict = {"max_tokens": 6, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.0, logit_bias={the: 5.0, comma: -100}, **base),
        SamplingParams(temperature=0.9, seed=5, allowed_token_ids=[the, first, comma], **base),
        SamplingParams(temperature=0.0, bad_words=["the", "first"], n=2, **base),
        SamplingParams(temperature=0.7, seed=8, **base),
        SamplingParams(temperature=0.0, truncate_prompt_tokens=6, **base),
    ]


def test_controls_match_with_async_scheduling_off_and_plain_rows_are_unchanged(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    the, first, comma = (
        tokenizer.encode(t, add_special_tokens=False)[0] for t in (" the", " first", ",")
    )
    batch = all_controls(the, first, comma)
    prompts = [PROMPT] * len(batch)
    on = llm.generate(prompts, batch, use_tqdm=False)
    sync = LLM(max_model_len=512, num_kv_blocks=512, max_num_seqs=16, async_scheduling=False)
    try:
        off = sync.generate(prompts, batch, use_tqdm=False)
    finally:
        sync.shutdown()
    tokens_on = [[list(c.token_ids) for c in o.outputs] for o in on]
    assert tokens_on == [[list(c.token_ids) for c in o.outputs] for o in off]
    assert comma not in tokens_on[1][0]
    assert set(tokens_on[2][0]) <= {the, first, comma}
    assert len(tokens_on[3]) == 2 and all(the not in t and first not in t for t in tokens_on[3])
    assert len(on[5].prompt_token_ids) == 6
    # The plain rows sample as they do without the controlled ones, and the shared params are unchanged.
    alone = llm.generate([PROMPT, PROMPT], [batch[0], batch[4]], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in alone] == [tokens_on[0][0], tokens_on[4][0]]
    assert batch[3].bad_words_token_ids is None
