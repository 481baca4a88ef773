"""Tool-call parsers: each format's calls and content on recorded-style outputs, and the streaming invariant (any
split of an output, pushed piece by piece, gives exactly the whole-output result) at every split point."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    StreamDelta,
    ToolParser,
)

VLLM_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


@dataclass(frozen=True)
class Case:
    """A model output for one parser, the calls it holds (name, arguments) and its content."""

    id: str
    parser: str
    text: str
    calls: tuple[tuple[str, dict[str, Any]], ...]
    content: str | None


def call(name: str, **arguments: Any) -> tuple[str, dict[str, Any]]:
    return (name, arguments)


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
HERMES_CASES = [
    Case(
        "single",
        "hermes",
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        (call("get_weather", city="Paris", unit="celsius"),),
        None,
    ),
    Case(
        "several",
        "hermes",
        f'<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": '
        '{"tz": "CET"}}\n</tool_call>\n',
        (call("get_weather", city="Paris", unit="celsius"), call("get_time", tz="CET")),
        None,
    ),
    Case(
        "text_around",
        "hermes",
        f"Let me check the weather.\n<tool_call>{WEATHER}</tool_call>\nDone.",
        (call("get_weather", city="Paris", unit="celsius"),),
        "Let me check the weather.\n\nDone.",
    ),
    Case(
        "malformed_json",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> sorry',
        (),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> sorry',
    ),
    Case(
        "bad_block_kept_as_content",
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>',
        (call("ping"),),
        '<tool_call>{"arguments": {}}</tool_call>\n',
    ),
    Case(
        "arguments_not_object",
        "hermes",
        'x<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
        (),
        'x<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    ),
    Case(
        "arguments_as_json_string",
        "hermes",
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
        (call("add", a=1, b=2),),
        None,
    ),
    Case(
        "unicode",
        "hermes",
        '<tool_call>{"name": "translate", "arguments": {"text": "São Paulo, 日本語 🌧", "to": "fr"}}'
        "</tool_call>",
        (call("translate", text="São Paulo, 日本語 🌧", to="fr"),),
        None,
    ),
    Case(
        "unterminated_at_end",
        "hermes",
        'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n',
        (call("get_time", tz="UTC"),),
        "Sure.\n",
    ),
    Case(
        "unterminated_cut",
        "hermes",
        'Sure.\n<tool_call>\n{"name": "get_time", "argu',
        (),
        'Sure.\n<tool_call>\n{"name": "get_time", "argu',
    ),
    Case(
        "lookalike_markup",
        "hermes",
        "Use a < b, or <tool_> and </tool_call> in prose: <tool_cal",
        (),
        "Use a < b, or <tool_> and </tool_call> in prose: <tool_cal",
    ),
    Case("whitespace_only_no_calls", "hermes", " \n ", (), " \n "),
]

LLAMA_CASES = [
    Case(
        "single",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        (call("get_weather", city="Paris"),),
        None,
    ),
    Case(
        "python_tag_several",
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, 2]}}',
        (call("a"), call("b", x=[1, 2])),
        None,
    ),
    Case(
        "arguments_key_and_whitespace",
        "llama3_json",
        ' \n{"name": "search", "arguments": {"q": "kv cache", "top": 3}} ;\n{"name": "done", '
        '"parameters": {}}\n',
        (call("search", q="kv cache", top=3), call("done")),
        None,
    ),
    Case(
        "text_before",
        "llama3_json",
        'Here is the call: {"name": "f", "parameters": {}}',
        (),
        'Here is the call: {"name": "f", "parameters": {}}',
    ),
    Case(
        "text_after",
        "llama3_json",
        '{"name": "f", "parameters": {}} Let me know!',
        (),
        '{"name": "f", "parameters": {}} Let me know!',
    ),
    Case(
        "malformed_json",
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"a": }',
        (),
        '<|python_tag|>{"name": "f", "parameters": {"a": }',
    ),
    Case(
        "plain_json_answer",
        "llama3_json",
        '{"name": "Ada Lovelace", "born": 1815}',
        (),
        '{"name": "Ada Lovelace", "born": 1815}',
    ),
    Case(
        "nan_is_not_json",
        "llama3_json",
        '{"name": "f", "parameters": {"x": NaN}}',
        (),
        '{"name": "f", "parameters": {"x": NaN}}',
    ),
    Case(
        "unicode",
        "llama3_json",
        '{"name": "translate", "parameters": {"text": "naïve café ☕", "to": "日本語"}}',
        (call("translate", text="naïve café ☕", to="日本語"),),
        None,
    ),
    Case(
        "plain_text",
        "llama3_json",
        "The weather in Paris is mild.",
        (),
        "The weather in Paris is mild.",
    ),
]

MISTRAL_CASES = [
    Case(
        "json_array_single",
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        (call("get_weather", city="Paris"),),
        None,
    ),
    Case(
        "json_array_several_text_before",
        "mistral",
        'Let me look.[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": 2}}]',
        (call("a"), call("b", n=2)),
        "Let me look.",
    ),
    Case(
        "v11_single",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        (call("get_weather", city="Paris"),),
        None,
    ),
    Case(
        "v11_several_text_before",
        "mistral",
        'Checking both. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
        '{"tz": "CET"}',
        (call("get_weather", city="Paris"), call("get_time", tz="CET")),
        "Checking both. ",
    ),
    Case(
        "malformed_section",
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": ',
        (),
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": ',
    ),
    Case(
        "text_after_calls",
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {}}] and then some',
        (),
        '[TOOL_CALLS][{"name": "a", "arguments": {}}] and then some',
    ),
    Case(
        "unicode",
        "mistral",
        '[TOOL_CALLS]translate[ARGS]{"text": "Grüße aus Köln 🎉", "to": "ja"}',
        (call("translate", text="Grüße aus Köln 🎉", to="ja"),),
        None,
    ),
    Case(
        "lookalike_markup",
        "mistral",
        "Use [TOOL] or [TOOL_CALL tags",
        (),
        "Use [TOOL] or [TOOL_CALL tags",
    ),
]

PYTHONIC_CASES = [
    Case(
        "single",
        "pythonic",
        '[get_weather(city="Paris", unit="celsius")]',
        (call("get_weather", city="Paris", unit="celsius"),),
        None,
    ),
    Case(
        "several_literals",
        "pythonic",
        '[search(query="kv cache", limit=5, filters={"lang": ["en", "fr"], "recent": True}), noop(), '
        "set_flag(on=False, value=None, ratio=-0.5, pair=(1, 2))]",
        (
            call(
                "search", query="kv cache", limit=5, filters={"lang": ["en", "fr"], "recent": True}
            ),
            call("noop"),
            call("set_flag", on=False, value=None, ratio=-0.5, pair=[1, 2]),
        ),
        None,
    ),
    Case(
        "wrapped",
        "pythonic",
        "<|python_start|>[get_time(tz='CET')]<|python_end|>",
        (call("get_time", tz="CET"),),
        None,
    ),
    Case("surrounding_whitespace", "pythonic", '\n  [f(a="x")]  \n', (call("f", a="x"),), None),
    Case(
        "unicode",
        "pythonic",
        '[translate(text="naïve café", to="日本語 🌸")]',
        (call("translate", text="naïve café", to="日本語 🌸"),),
        None,
    ),
    Case("plain_text", "pythonic", "The answer is 42.", (), "The answer is 42."),
    Case("positional_arguments", "pythonic", "[f(1, 2)]", (), "[f(1, 2)]"),
    Case("syntax_error", "pythonic", "[f(a=1]", (), "[f(a=1]"),
    Case("text_after", "pythonic", "[f(a=1)] and more", (), "[f(a=1)] and more"),
    Case(
        "markdown_link",
        "pythonic",
        "[docs](https://example.com) say so",
        (),
        "[docs](https://example.com) say so",
    ),
    Case("method_call", "pythonic", "[client.get(a=1)]", (), "[client.get(a=1)]"),
    Case("set_is_not_json", "pythonic", "[f(a={1, 2})]", (), "[f(a={1, 2})]"),
    Case("repeated_keyword", "pythonic", "[f(a=1, a=2)]", (), "[f(a=1, a=2)]"),
    Case("not_a_call", "pythonic", "[1, 2, 3]", (), "[1, 2, 3]"),
]

ALL_CASES = HERMES_CASES + LLAMA_CASES + MISTRAL_CASES + PYTHONIC_CASES
CASE_IDS = [f"{case.parser}-{case.id}" for case in ALL_CASES]


def make_parser(name: str) -> ToolParser:
    return TOOL_PARSERS.get(name)(None)


def id_pattern(parser: str) -> re.Pattern[str]:
    return MISTRAL_ID if parser == "mistral" else VLLM_ID


def expected_arguments(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def run_stream(parser: ToolParser, pieces: list[str]) -> list[StreamDelta]:
    stream = parser.stream()
    return [stream.push(piece) for piece in pieces] + [stream.finish()]


def assemble(deltas: list[StreamDelta], ids: re.Pattern[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) calls a stream released; checks the fragments' id/name/index rules."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    seen_ids: set[str] = set()
    for delta in deltas:
        for fragment in delta.tool_calls:
            if fragment.index not in names:
                assert fragment.index == len(names), "calls must be opened in index order"
                assert fragment.name and fragment.id and ids.fullmatch(fragment.id)
                assert fragment.id not in seen_ids
                seen_ids.add(fragment.id)
                names[fragment.index] = fragment.name
                arguments[fragment.index] = ""
            else:
                assert fragment.id is None and fragment.name is None
            arguments[fragment.index] += fragment.arguments
    content = "".join(delta.content for delta in deltas)
    return content, [(names[index], arguments[index]) for index in sorted(names)]


def check_extracted(case: Case, extracted: ExtractedToolCalls) -> None:
    assert extracted.content == case.content
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == [
        (name, expected_arguments(arguments)) for name, arguments in case.calls
    ]
    assert all(id_pattern(case.parser).fullmatch(c.id) for c in extracted.tool_calls)
    assert len({c.id for c in extracted.tool_calls}) == len(extracted.tool_calls)


def check_split(parser_name: str, text: str, pieces: list[str]) -> None:
    """The streaming invariant for one split of `text`."""
    assert "".join(pieces) == text
    parser = make_parser(parser_name)
    whole = parser.extract_tool_calls(text)
    content, calls = assemble(run_stream(parser, pieces), id_pattern(parser_name))
    assert content == (whole.content or ""), pieces
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls], pieces


def splits(text: str, seed: int) -> Iterator[list[str]]:
    """Every split into two pieces, one character at a time, and seeded random multi-piece splits."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(8):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        yield [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_extract(case: Case) -> None:
    check_extracted(case, make_parser(case.parser).extract_tool_calls(case.text))


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_stream_matches_whole_output_at_every_split(case: Case) -> None:
    for pieces in splits(case.text, seed=CASE_IDS.index(f"{case.parser}-{case.id}")):
        check_split(case.parser, case.text, pieces)
    # The whole-output view these splits were checked against is the expected one.
    content, calls = assemble(
        run_stream(make_parser(case.parser), list(case.text)), id_pattern(case.parser)
    )
    assert content == (case.content or "")
    assert calls == [(name, expected_arguments(arguments)) for name, arguments in case.calls]


# Pieces of each format's markup and JSON, glued at random into outputs well-formed or not, so the invariant is
# checked on outputs nobody wrote down (partial markers, markers inside JSON, blocks cut anywhere).
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "</tool", '{"name": "f", "arguments": {"a": 1}}',
               '{"name": "g"}', '{"name": 1}', "{", "}", '"', "\n", " ", "x", "é"],
    "llama3_json": ["<|python_tag|>", "<|python", '{"name": "f", "parameters": {"a": [1]}}',
                    '{"name": "g", "arguments": {}}', ";", "; ", "{", "}", " ", "\n", "x", "ü"],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "get", '{"a": 1}', "{", '[{"name": "f", "arguments": {}}]',
                "[", "]", " ", "x", "ß"],
    "pythonic": ["<|python_start|>", "<|python_end|>", "<|python", "[", "]", "f(", "g(a=1)", "a=", "True",
                 "(", ")", ",", " ", '"é"', "x"],
}  # fmt: skip


@pytest.mark.parametrize("parser_name", list(FRAGMENTS))
def test_stream_matches_whole_output_on_random_outputs(parser_name: str) -> None:
    @settings(max_examples=150, deadline=None, database=None)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        parts = data.draw(st.lists(st.sampled_from(FRAGMENTS[parser_name]), max_size=10))
        text = "".join(parts)
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6).map(sorted))
        pieces = [
            text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)
        ]
        check_split(parser_name, text, pieces)

    check()


def test_hermes_releases_content_and_calls_as_they_complete() -> None:
    stream = make_parser("hermes").stream()
    assert stream.push("Hello <tool").content == "Hello "  # a possible marker start is held back
    delta = stream.push('_call>{"name": "f", "arguments": {"a": "é"}}')
    assert delta == StreamDelta(content="", tool_calls=[])  # an open block is buffered
    delta = stream.push("</tool_call> <tool_c")
    [fragment] = delta.tool_calls
    assert (fragment.index, fragment.name, fragment.arguments) == (0, "f", '{"a": "é"}')
    assert delta.content == " "
    assert (
        stream.push("ode> done").content == "<tool_code> done"
    )  # a lookalike is released once it differs
    assert stream.finish() == StreamDelta(content="", tool_calls=[])


def test_whitespace_only_content_is_never_released_when_there_are_calls() -> None:
    stream = make_parser("hermes").stream()
    assert stream.push("\n\n").content == ""
    assert stream.push('<tool_call>{"name": "f"}</tool_call>\n').tool_calls[0].name == "f"
    assert stream.finish().content == ""
    # Without calls the same whitespace is the content.
    stream = make_parser("hermes").stream()
    assert stream.push("\n\n").content == ""
    assert stream.finish().content == "\n\n"


def test_mistral_releases_content_before_the_marker() -> None:
    stream = make_parser("mistral").stream()
    assert stream.push("Checking. [TOOL").content == "Checking. "
    assert stream.push('_CALLS]f[ARGS]{"a": 1}') == StreamDelta(content="", tool_calls=[])
    [fragment] = stream.finish().tool_calls
    assert (fragment.name, fragment.arguments) == ("f", '{"a": 1}')
    assert MISTRAL_ID.fullmatch(fragment.id or "")


@pytest.mark.parametrize(
    ("parser_name", "first_piece"),
    [("llama3_json", " <|python"), ("pythonic", "\n<|py")],
)
def test_whole_output_formats_pass_plain_answers_through(
    parser_name: str, first_piece: str
) -> None:
    stream = make_parser(parser_name).stream()
    assert stream.push(first_piece).content == ""  # might still become a call
    assert stream.push(" no, just text").content == first_piece + " no, just text"
    assert stream.push(" and more").content == " and more"
    assert stream.finish() == StreamDelta(content="", tool_calls=[])


def test_streams_of_one_parser_are_independent() -> None:
    parser = make_parser("hermes")
    first, second = parser.stream(), parser.stream()
    first.push('<tool_call>{"name": "a"')
    assert second.push("plain").content == "plain"
    [fragment] = first.push("}</tool_call>").tool_calls
    assert (fragment.index, fragment.name) == (0, "a")
    assert second.finish() == StreamDelta(content="", tool_calls=[])
    with pytest.raises(RuntimeError):
        second.push("more")


def test_registry() -> None:
    assert set(TOOL_PARSERS.names()) == {"hermes", "llama3_json", "mistral", "pythonic"}
    for name in TOOL_PARSERS.names():
        parser_class = TOOL_PARSERS.get(name)
        assert issubclass(parser_class, ToolParser) and parser_class.name == name
    assert TOOL_PARSERS.get("mistral").keeps_special_tokens
    assert not TOOL_PARSERS.get("pythonic").keeps_special_tokens
    with pytest.raises(
        ValueError, match=r"tool call parser 'nope'.*hermes, llama3_json, mistral, pythonic"
    ):
        TOOL_PARSERS.get("nope")


# ------------------------------------------------------------------------------------------ forced calls cut short
CUT_REPLIES = [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "param', ["a"], '{"name": "b", "param'),
    ('[{"name": "a", "parame', [], '[{"name": "a", "parame'),
    ("[", [], "["),
    ('[{"name": "a", "parameters": {}}, ', ["a"], None),
    ('[{"name": "a", "parameters": {"x": "]"}}]\n', ["a"], None),  # complete: no content
]


@pytest.mark.parametrize(("text", "names", "content"), CUT_REPLIES)
def test_a_required_reply_cut_short_keeps_its_closed_calls_and_the_rest_as_content(
    text: str, names: list[str], content: str | None
) -> None:
    """Nothing generated is lost (issue: a forced call cut by max_tokens came back as no call and no content): the
    calls that closed are calls, the text after them is content, whole and streamed at every split alike."""
    from kvflow.entrypoints.openai.tool_calls import RequiredToolCallsParser

    parser = RequiredToolCallsParser({"a", "b"})
    whole = parser.extract_tool_calls(text)
    assert [call.name for call in whole.tool_calls] == names
    assert whole.content == content
    for split in range(len(text) + 1):
        stream = parser.stream()
        first, second, final = stream.push(text[:split]), stream.push(text[split:]), stream.finish()
        streamed_calls = [*first.tool_calls, *second.tool_calls, *final.tool_calls]
        assert [call.name for call in streamed_calls] == names
        assert [call.arguments for call in streamed_calls] == [
            call.arguments for call in whole.tool_calls
        ]
        streamed_content = first.content + second.content + final.content
        assert (streamed_content or None) == content
