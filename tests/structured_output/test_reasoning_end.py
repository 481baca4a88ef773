"""A structured-output constraint starts where the output's reasoning ends (vLLM's rule, under a reasoning parser).

The end marker is found on token bytes: the built-in model's byte-level BPE spells `</think>` over five tokens. On
the built-in model a thought that never closes runs unconstrained, and a prompt that closed it is constrained from
the first token. On the hash-logits model, whose synthetic vocabulary is given tokens that spell the markers, the
switch is driven token by token: the matcher must receive exactly the tokens after the marker, also when a forced
preemption discards tokens in flight around the switch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvflow import LLM, SamplingParams, StructuredOutputsParams
from kvflow.config import StructuredOutputsConfig
from kvflow.default_model import SHIPPED_CHECKPOINT
from kvflow.engine.core import EngineCore
from kvflow.models.hash_model import hash_grammar_stop_token_id, next_token
from kvflow.reasoning import REASONING_PARSERS
from kvflow.request import Request
from kvflow.structured_output.backend import GrammarVocab, StructuredOutputGrammar
from kvflow.structured_output.manager import StructuredOutputManager
from kvflow.structured_output.reasoning_end import ReasoningEndDetector, ReasoningGate, TokenTexts
from kvflow.structured_output.setup import _hash_vocab
from kvflow.testing.hash_model import reference_tokens
from kvflow.tokenizer import Tokenizer, load_tokenizer
from tests.engine.engine_simulation import BOUNDED, constrained_reference, make_engine_core

VOCAB_SIZE = 50256
STOP = hash_grammar_stop_token_id(VOCAB_SIZE)
# Token ids of the hash-logits vocabulary given marker texts for prompts (the model outputs them rarely).
PROMPT_THINK, PROMPT_END_THINK = 1000, 1001
PROMPT = [5, 6, 7]


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def builtin_texts() -> tuple[Tokenizer, TokenTexts]:
    tokenizer = load_tokenizer(SHIPPED_CHECKPOINT)
    return tokenizer, TokenTexts.of_vocab(GrammarVocab(4096, (), tokenizer=tokenizer))


def _detect(detector: ReasoningEndDetector, token_ids: Sequence[int]) -> int | None:
    """The index of the token that ended the reasoning, or None."""
    for index, token_id in enumerate(token_ids):
        if detector.accept(token_id):
            return index
    return None


def _vocab(overrides: dict[int, bytes]) -> GrammarVocab:
    base = _hash_vocab(VOCAB_SIZE)
    token_bytes = list(base.token_bytes)  # type: ignore[arg-type]
    for token_id, text in {
        PROMPT_THINK: b"<think>",
        PROMPT_END_THINK: b"</think>",
        **overrides,
    }.items():
        token_bytes[token_id] = text
    return GrammarVocab(VOCAB_SIZE, base.eos_token_ids, token_bytes=token_bytes)


class RecordingGrammar(StructuredOutputGrammar):
    """A matcher that logs the tokens it accepts (all-or-nothing, as the real one)."""

    def __init__(self, inner: StructuredOutputGrammar, log: list[int]) -> None:
        self.inner, self.log = inner, log

    @property  # type: ignore[override]
    def num_processed_tokens(self) -> int:
        return self.inner.num_processed_tokens

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        accepted = self.inner.accept_tokens(token_ids)
        if accepted:
            self.log.extend(token_ids)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        raise AssertionError("nothing is ever rolled back")

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


def _core(
    parser: str | None,
    overrides: dict[int, bytes] | None = None,
    *,
    async_scheduling: bool = False,
    enable_in_reasoning: bool = False,
) -> tuple[EngineCore, list[list[int]]]:
    """A hash-logits core whose manager compiles over `_vocab(overrides)`; returns it and the accept logs of the
    matchers it starts, in order."""
    core = make_engine_core(
        model="hash-logits", async_scheduling=async_scheduling, num_blocks=64, max_num_seqs=2
    )
    vocab = _vocab(overrides or {})
    config = StructuredOutputsConfig(
        reasoning_parser=parser, enable_in_reasoning=enable_in_reasoning
    )
    manager = StructuredOutputManager(config, lambda: vocab, VOCAB_SIZE)
    compile_now = manager._compile_now
    logs: list[list[int]] = []

    def recording_compile(params: StructuredOutputsParams):  # type: ignore[no-untyped-def]
        factory = compile_now(params)

        def start() -> StructuredOutputGrammar:
            logs.append([])
            return RecordingGrammar(factory(), logs[-1])

        return start

    manager._compile_now = recording_compile  # type: ignore[method-assign]
    core.structured_output_manager = manager
    return core, logs


def _request(
    request_id: str, prompt: list[int], max_tokens: int, resumable: bool = False
) -> Request:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=BOUNDED
    )
    return Request(request_id, prompt, params, eos_token_id=50256, resumable=resumable)


def _run(core: EngineCore, max_steps: int = 300) -> list[int]:
    tokens: list[int] = []
    for _ in range(max_steps):
        if not core.has_work():
            return tokens
        for output in core.step():
            assert output.finish_reason != "error", output.stop_reason
            tokens += output.new_token_ids
    raise AssertionError("the engine did not go idle")


def _bounded_after(history: list[int], max_tokens: int, excluded: set[int]) -> list[int]:
    """`constrained_reference(..., "bounded")` for a constraint that starts after `history`, in a vocabulary whose
    `excluded` tokens spell no `a<i>` / `b<i>` (their text was replaced), so the grammar never allows them."""
    history = list(history)
    output: list[int] = []
    parity = num_pairs = 0
    for _ in range(max_tokens):
        may_end, must_end = parity == 0 and num_pairs >= 1, num_pairs == 3
        token = next_token(history, VOCAB_SIZE)
        while not (
            (token == STOP and may_end)
            or (token != STOP and token % 2 == parity and not must_end and token not in excluded)
        ):
            token = (token + 1) % VOCAB_SIZE
        output.append(token)
        history.append(token)
        if token == STOP:
            break
        num_pairs += parity
        parity ^= 1
    return output


# ------------------------------------------------------------------------------------------------ (a) detector
def test_detector_finds_the_marker_spelled_over_several_tokens(
    builtin_texts: tuple[Tokenizer, TokenTexts],
) -> None:
    tokenizer, texts = builtin_texts
    ids = tokenizer.encode("Let me think.\n</think>\n\nyes", add_special_tokens=False)
    first_with_marker = next(
        i for i in range(len(ids)) if "</think>" in tokenizer.decode(ids[: i + 1])
    )
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1  # no single marker token
    assert _detect(ReasoningEndDetector(b"</think>", texts), ids) == first_with_marker
    assert texts.decode(ids) == tokenizer.decode(ids)
    # A special token inside the marker: the detokenized text (skip_special_tokens) still spells it.
    im_end = tokenizer.token_to_id("<|im_end|>")
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    split = [*marker[:2], im_end, *marker[2:]]
    assert "</think>" in tokenizer.decode(split, skip_special_tokens=True)
    assert _detect(ReasoningEndDetector(b"</think>", texts, True), split) == len(split) - 1
    assert "</think>" not in tokenizer.decode(split, skip_special_tokens=False)
    assert _detect(ReasoningEndDetector(b"</think>", texts, False), split) is None


def test_detector_on_a_token_with_text_past_the_marker_keeps_a_short_tail() -> None:
    texts = TokenTexts([b"a", b"</", b"thin", b"k>\n\nYes", b"<think>", b"</think"])
    detector = ReasoningEndDetector(b"</think>", texts)
    assert _detect(detector, [4, 0, 0, 5, 0, *[1, 2, 0] * 50]) is None  # near misses
    assert len(detector.tail) <= len(b"</think>") - 1
    assert _detect(ReasoningEndDetector(b"</think>", texts), [0, 1, 2, 3, 0]) == 3


def test_the_prompt_decides_where_the_output_starts(
    builtin_texts: tuple[Tokenizer, TokenTexts],
) -> None:
    tokenizer, texts = builtin_texts

    def starts_in_reasoning(parser: str, prompt: str) -> bool:
        gate = ReasoningGate(REASONING_PARSERS.get(parser)(), texts)
        return gate.detector_for(tokenizer.encode(prompt), True) is not None

    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert starts_in_reasoning("deepseek_r1", chat)
    assert not starts_in_reasoning("deepseek_r1", chat + "<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("qwen3", chat)
    assert starts_in_reasoning("qwen3", chat + "<think>\n")
    assert not starts_in_reasoning("qwen3", chat + "<think>\n\n</think>\n\n")


# ------------------------------------------------------------------------------------------------ (b) built-in
@pytest.fixture(scope="module")
def r1_llm() -> LLM:
    return LLM(reasoning_parser="deepseek_r1", max_num_seqs=2, max_model_len=256, num_kv_blocks=64)


def test_builtin_model_reasons_unconstrained_until_the_prompt_closes_the_thought(
    r1_llm: LLM,
) -> None:
    """The built-in model never writes `</think>`: under deepseek_r1 its whole output is reasoning, so a choice
    constraint changes nothing; a prompt that closed the thought (Qwen3's enable_thinking=False rendering) is
    constrained from its first token."""
    choices = ["yes", "no"]
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    prompt = "The capital of France is"
    [free, thinking] = r1_llm.generate([prompt, prompt], [plain, constrained], use_tqdm=False)
    assert thinking.outputs[0].text == free.outputs[0].text
    assert thinking.outputs[0].text not in choices and "</think>" not in free.outputs[0].text
    closed = r1_llm.generate([prompt + "<think>\n\n</think>\n\n"], constrained, use_tqdm=False)
    assert closed[0].outputs[0].text in choices


# ------------------------------------------------------------------------------------------------ (c) options
@pytest.mark.parametrize(
    ("parser", "enable_in_reasoning", "prompt", "constrained_from_start"),
    [
        ("deepseek_r1", True, PROMPT, True),  # the constraint covers the reasoning too
        ("deepseek_r1", False, [*PROMPT, PROMPT_THINK], False),  # R1's template opened it
        (
            "deepseek_r1",
            False,
            [*PROMPT, PROMPT_THINK, PROMPT_END_THINK],
            True,
        ),  # closed by the prompt
        ("qwen3", False, PROMPT, True),  # no `<think>` open: constrained, so it can never open one
        ("qwen3", False, [*PROMPT, PROMPT_THINK], False),  # Qwen3-Thinking's template opened it
    ],
)
def test_where_the_constraint_starts(
    parser: str, enable_in_reasoning: bool, prompt: list[int], constrained_from_start: bool
) -> None:
    core, logs = _core(parser, enable_in_reasoning=enable_in_reasoning)
    try:
        core.add_request(_request("r", prompt, max_tokens=8))
        tokens = _run(core)
    finally:
        core.shutdown()
    if constrained_from_start:
        assert tokens == constrained_reference(prompt, 8, "bounded") == logs[0]
    else:  # the whole output is an unclosed thought
        assert tokens == reference_tokens(prompt, 8) and logs == [[]]


# ------------------------------------------------------------------------------------------------ (d) switch
def _marker_plan(last_piece: bytes) -> tuple[list[int], dict[int, bytes], int]:
    """The hash model's unconstrained output for PROMPT, with its tokens 4..6 given texts that spell `</think>`
    (the last maybe carrying text past it): the reference tokens, the overrides, and the first constrained
    output index."""
    reference = reference_tokens(PROMPT, 7)
    marker_ids = reference[4:7]
    assert len(set(marker_ids)) == 3 and not set(marker_ids) & {*reference[:4], STOP}
    pieces = [b"</", b"think" if last_piece == b">" else b"thin", last_piece]
    return reference, dict(zip(marker_ids, pieces, strict=True)), 7


@pytest.mark.parametrize("last_piece", [b">", b"k>\n\nab"])
@pytest.mark.parametrize(
    ("async_scheduling", "reset_at"),
    [(False, None), (True, None), (True, 5), (True, 6), (True, 7)],
    ids=["sync", "async", "async-reset-before", "async-reset-at-marker", "async-reset-after"],
)
def test_the_switch_is_exact_under_async_scheduling_and_preemption(
    last_piece: bytes, async_scheduling: bool, reset_at: int | None
) -> None:
    """Reasoning runs unconstrained through the token that completes the marker; the matcher takes every later
    kept token, once. `reset_at`: once the request keeps that many tokens, a forced reset preempts it with
    tokens in flight (async), which are discarded and recomputed, so none may reach the detector or matcher."""
    reference, overrides, first_constrained = _marker_plan(last_piece)
    expected = reference + _bounded_after(PROMPT + reference, 16 - 7, set(overrides))
    # The switch is visible: the unmasked model would have continued differently.
    assert reference_tokens(PROMPT, 8)[7] != expected[7]
    core, logs = _core("deepseek_r1", overrides, async_scheduling=async_scheduling)
    num_resets = 0
    try:
        request = _request("r", PROMPT, max_tokens=16)
        core.add_request(request)
        tokens: list[int] = []
        for _ in range(300):
            if not core.has_work():
                break
            for output in core.step():
                tokens += output.new_token_ids
            if reset_at is not None and not num_resets and request.num_output_tokens >= reset_at:
                assert request.num_output_placeholders > 0  # tokens in flight are discarded
                assert core.reset_prefix_cache(reset_running_requests=True)
                num_resets += 1
        so_request = request.structured_output_request
        assert so_request is not None
    finally:
        core.shutdown()
    assert tokens == expected
    assert logs == [expected[first_constrained:]]
    assert so_request.num_reasoning_tokens == first_constrained
    assert so_request.num_reasoning_tokens + so_request.grammar.num_processed_tokens == len(tokens)
    assert request.num_preemptions == num_resets


def test_a_streaming_chunk_reevaluates_reasoning_from_its_prompt() -> None:
    """Chunk 1 starts in reasoning (deepseek_r1, nothing closed it): unconstrained. Chunk 2's prompt closes the
    thought: its continuation is constrained from the first token, by a fresh matcher."""
    core, logs = _core("deepseek_r1")
    try:
        core.add_request(_request("s", PROMPT, max_tokens=4, resumable=True))
        first = _run(core)
        assert first == reference_tokens(PROMPT, 4) and logs == [[]]
        core.add_request(_request("s", [PROMPT_END_THINK], max_tokens=8))
        second = _run(core)
    finally:
        core.shutdown()
    prompt2 = [*PROMPT, *first[:-1], PROMPT_END_THINK]
    assert second == constrained_reference(prompt2, 8, "bounded")
    assert logs == [[], second]
