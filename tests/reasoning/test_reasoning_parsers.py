"""Reasoning parsers: recorded-style Qwen3 and DeepSeek-R1 outputs split whole and streamed. The stream must give
exactly the whole split for every way an output can arrive in pieces (every 2-piece split, random splits, one
character at a time), and never let a marker through."""

from __future__ import annotations

import itertools
import random

import pytest

from kvflow.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningSplit
from kvflow.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kvflow.reasoning.qwen3 import Qwen3ReasoningParser

QWEN3 = Qwen3ReasoningParser()
# DeepSeek-R1's user turn and assistant tag (its special tokens use full-width bars).
R1_TURN = "<\uff5cUser\uff5c>Hi<\uff5cAssistant\uff5c>"
DEEPSEEK_R1 = DeepSeekR1ReasoningParser()

# (parser, output, starts_in_reasoning, expected reasoning, expected content)
RECORDED = [
    # Qwen3 opens its own thought.
    (
        QWEN3,
        "<think>\nOkay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**.",
        False,
        "Okay, the user asks for 2 + 2. That is 4.",
        "The answer is **4**.",
    ),
    # Qwen3-Thinking-2507: the template opened it.
    (QWEN3, "Let me see.\n\nFirst, 2.\n</think>\n\nTwo.", True, "Let me see.\n\nFirst, 2.", "Two."),
    # A thought cut short by max_tokens: all reasoning.
    (
        QWEN3,
        "<think>\nLet me consider the options.\nFirst, ",
        False,
        "Let me consider the options.\nFirst, ",
        None,
    ),
    # An empty thought (what enable_thinking=False renders, written by the model).
    (QWEN3, "<think>\n\n</think>\n\nHello! How can I help?", False, None, "Hello! How can I help?"),
    # No thought at all, or a prompt that closed it (enable_thinking=False): all content.
    (QWEN3, "Hello! How can I help?", False, None, "Hello! How can I help?"),
    (QWEN3, "\n\nHi.\n", False, None, "Hi.\n"),
    # Not a marker: `<thinking>` is content.
    (QWEN3, "<thinking> is a tag", False, None, "<thinking> is a tag"),
    # Whitespace before the start marker is dropped with it.
    (QWEN3, " \n<think>x</think>y", False, "x", "y"),
    # DeepSeek-R1: the template opened the thought.
    (
        DEEPSEEK_R1,
        "Okay, so I need to add 2 and 2.\n</think>\n\nThe sum is 4.",
        True,
        "Okay, so I need to add 2 and 2.",
        "The sum is 4.",
    ),
    # ... and a leading `<think>` the model writes anyway is dropped.
    (DEEPSEEK_R1, "<think>\nHmm.\n</think>\n\n4", True, "Hmm.", "4"),
    (DEEPSEEK_R1, "Still thinking about </thin", True, "Still thinking about </thin", None),
    (DEEPSEEK_R1, "", True, None, None),
    (DEEPSEEK_R1, "</think>", True, None, None),
    # Only the first end marker ends the reasoning; content after it is verbatim.
    (DEEPSEEK_R1, "a </thin b</think>c</think>", True, "a </thin b", "c</think>"),
    (DEEPSEEK_R1, "思考 🤔\n</think>\n\n答案 ✓", True, "思考 🤔", "答案 ✓"),
]

# More outputs for the streaming invariant, tried under both starting states.
EXTRA_OUTPUTS = [
    "",
    "\n",
    "<",
    "<think",
    "<think>",
    "  <think",
    "<think>\n",
    "</think>",
    "\n\n</think>\n\n",
    "<think></think>",
    "<think>a\n\n\nb\n\n</thi",
    "<think>\n\n\n</think>\n\n\n\nx\n\n",
    "x\n</think>\n<think>y",
    "<<think>>",
    "<think><think>a</think></think>",
    "a\n\n<\n</</think></think>",
    "\t<think>\r\nx\r\n</think>\r\ny",
]


def _outputs() -> list[tuple[ReasoningParser, str, bool]]:
    cases = [(parser, text, starts) for parser, text, starts, _, _ in RECORDED]
    for parser in (QWEN3, DEEPSEEK_R1):
        for text in EXTRA_OUTPUTS + [text for _, text, _, _, _ in RECORDED]:
            cases.extend((parser, text, starts) for starts in (False, True))
    return cases


def _streamed(parser: ReasoningParser, pieces: list[str], starts: bool) -> ReasoningSplit:
    stream = parser.stream(starts)
    reasoning: list[str] = []
    content: list[str] = []
    for piece in pieces:
        reasoning_piece, content_piece = stream.push(piece)
        reasoning.append(reasoning_piece)
        content.append(content_piece)
    reasoning_piece, content_piece = stream.finish()
    reasoning.append(reasoning_piece)
    content.append(content_piece)
    assert parser.end_marker not in "".join(reasoning)  # reasoning ends at the first end marker
    return ReasoningSplit("".join(reasoning) or None, "".join(content) or None)


def _random_splits(text: str, rng: random.Random, count: int) -> list[list[str]]:
    splits = []
    for _ in range(count):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        bounds = [0, *cuts, len(text)]
        splits.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return splits


@pytest.mark.parametrize(("parser", "text", "starts", "reasoning", "content"), RECORDED)
def test_recorded_outputs_split(
    parser: ReasoningParser, text: str, starts: bool, reasoning: str | None, content: str | None
) -> None:
    assert parser.extract_reasoning(text, starts) == ReasoningSplit(reasoning, content)
    assert _streamed(parser, [text], starts) == ReasoningSplit(reasoning, content)


def test_stream_equals_extract_for_every_split() -> None:
    """Every 2-piece split, 20 random multi-piece splits (empty pieces included) and one char at a time."""
    rng = random.Random(0)
    for parser, text, starts in _outputs():
        expected = parser.extract_reasoning(text, starts)
        assert parser.end_marker not in (expected.reasoning or "")
        splits = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]
        splits += _random_splits(text, rng, 20)
        splits.append(list(text))
        for pieces in splits:
            assert _streamed(parser, pieces, starts) == expected, (parser.name, text, pieces)


def test_stream_releases_text_as_soon_as_it_is_unambiguous() -> None:
    stream = QWEN3.stream(starts_in_reasoning=False)
    assert stream.push(" ") == ("", "")  # could still open a thought
    assert stream.push("<th") == ("", "")
    assert stream.push("ink>\nStep 1") == ("Step 1", "")
    assert stream.push("\n</th") == ("", "")  # the newline is trimmed if the marker completes
    assert stream.push("e") == ("\n</the", "")
    assert stream.push("</think>\n\nDone") == ("", "Done")
    assert stream.finish() == ("", "")
    plain = QWEN3.stream(starts_in_reasoning=False)
    assert plain.push("Hi") == ("", "Hi")
    truncated = DEEPSEEK_R1.stream(starts_in_reasoning=True)
    assert truncated.push("a\n\n</thi") == ("a", "")
    assert truncated.finish() == ("\n\n</thi", "")


@pytest.mark.parametrize(
    ("parser", "prompt", "starts"),
    [
        (QWEN3, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        (QWEN3, "<|im_start|>assistant\n<think>\n", True),
        (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        (QWEN3, "<think>a</think>b<|im_start|>assistant\n<think>\n", True),
        (DEEPSEEK_R1, R1_TURN, True),
        (DEEPSEEK_R1, f"{R1_TURN}<think>\n", True),
        (DEEPSEEK_R1, f"{R1_TURN}<think>\n\n</think>\n\n", False),
        (DEEPSEEK_R1, f"{R1_TURN}</think>", False),
    ],
)
def test_starts_in_reasoning_from_the_prompt(
    parser: ReasoningParser, prompt: str, starts: bool
) -> None:
    assert parser.starts_in_reasoning(prompt) is starts


def test_registry() -> None:
    assert REASONING_PARSERS.names() == ("qwen3", "deepseek_r1")
    for name in REASONING_PARSERS:
        parser_class = REASONING_PARSERS.get(name)
        assert issubclass(parser_class, ReasoningParser)
        assert parser_class.name == name
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'granite'.*qwen3, deepseek_r1"):
        REASONING_PARSERS.get("granite")
