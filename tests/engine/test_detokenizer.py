"""Incremental detokenization: exact streaming decode, multi-byte characters, stop strings and held-back text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from kvflow.default_model.random_weights import build_random_model
from kvflow.engine.detokenizer import IncrementalDetokenizer, decode_token, find_stop_string
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import Tokenizer, load_tokenizer

BOS_ID, END_OF_TEXT_ID, IM_START_ID, IM_END_ID = 1020, 1021, 1022, 1023


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("random") / "model"
    build_random_model(folder)  # its tokenizer's ids are fixed: 1024 entries, specials 1020-1023
    return load_tokenizer(folder)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    tokenizer: Tokenizer,
    token_ids: list[int],
    params: SamplingParams,
    *,
    prompt: list[int] | None = None,
    chunk_sizes: list[int] | None = None,
    stop_terminated: bool = False,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed `token_ids` in chunks, collecting each step's delta; returns (detokenizer, deltas, stop string)."""
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt if prompt is not None else [BOS_ID], params
    )
    deltas: list[str] = []
    position, step = 0, 0
    stop_string = None
    while position < len(token_ids):
        size = chunk_sizes[step % len(chunk_sizes)] if chunk_sizes else 1
        chunk = token_ids[position : position + size]
        position += size
        step += 1
        last = position >= len(token_ids)
        stop_string = detokenizer.update(chunk, stop_terminated and last)
        finished = last or stop_string is not None
        deltas.append(detokenizer.get_next_output_text(finished, delta=True))
        if stop_string is not None:
            break
    return detokenizer, deltas, stop_string


# ---------------------------------------------------------------------------------------------------- exact decoding
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_streams_equal_full_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    """Random ids over the whole vocabulary (partial UTF-8, invalid bytes and special tokens included), random
    prompts and chunkings: the streamed text equals one full decode."""
    rng = random.Random(1234)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 8))]
        chunk_sizes = [rng.randint(1, 4) for _ in range(3)]
        detokenizer, deltas, _ = _stream(
            tokenizer, token_ids, params, prompt=prompt, chunk_sizes=chunk_sizes
        )
        expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, (token_ids, prompt)
        assert detokenizer.output_text == expected
        assert detokenizer.get_next_output_text(finished=True, delta=False) == expected
        assert detokenizer.num_output_tokens == len(token_ids)


def test_random_byte_tokens_stream_exactly(tokenizer: Tokenizer) -> None:
    """Single-byte tokens only: every multi-byte character is split, many sequences are invalid UTF-8."""
    byte_ids = [tokenizer.token_to_id(char) for char in pre_tokenizers.ByteLevel.alphabet()]
    rng = random.Random(99)
    for _ in range(200):
        token_ids = [rng.choice(byte_ids) for _ in range(rng.randint(1, 24))]
        _, deltas, _ = _stream(tokenizer, token_ids, SamplingParams())
        assert "".join(deltas) == tokenizer.decode(token_ids)


@pytest.mark.parametrize(
    "text",
    [
        "日本語のテキスト",
        "rocket 🚀 party 🎉 family 👨‍👩‍👧!",
        "crème brûlée, naïve café",
        "∑ √ ≈ — “quotes”",
        "mixed: abc 中文 def 🇫🇷 xyz",
    ],
)
def test_split_characters_never_show_replacement_chars(tokenizer: Tokenizer, text: str) -> None:
    token_ids = _ids(tokenizer, text)
    assert any(
        "\ufffd" in decode_token(tokenizer, token_id) for token_id in token_ids
    )  # characters are split
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID], SamplingParams())
    streamed = ""
    for token_id in token_ids:
        detokenizer.update([token_id], stop_terminated=False)
        delta = detokenizer.get_next_output_text(finished=False, delta=True)
        assert "\ufffd" not in delta and "\ufffd" not in detokenizer.output_text
        streamed += delta
        assert text.startswith(streamed)
    streamed += detokenizer.get_next_output_text(finished=True, delta=True)
    assert streamed == text


def test_incomplete_character_at_the_end_is_released_on_finish(tokenizer: Tokenizer) -> None:
    token_ids = _ids(tokenizer, "go 🚀")[:-1]  # the rocket's last byte never arrives
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID], SamplingParams())
    detokenizer.update(token_ids, stop_terminated=False)
    assert detokenizer.get_next_output_text(finished=False, delta=False) == "go "
    final = detokenizer.get_next_output_text(finished=True, delta=False)
    assert final == tokenizer.decode(token_ids) and final.endswith("\ufffd")


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    """The prompt holds the first bytes of a character and the output the rest: the output alone decodes to
    replacement characters, exactly like decoding its ids."""
    all_ids = _ids(tokenizer, "a🚀b")
    prompt, output = all_ids[:2], all_ids[2:]
    _, deltas, _ = _stream(tokenizer, output, SamplingParams(), prompt=prompt)
    assert "".join(deltas) == tokenizer.decode(output)


def test_leading_spaces_and_whitespace_are_kept(tokenizer: Tokenizer) -> None:
    text = " Hello,  world!\n\n\tIndented   text "
    _, deltas, _ = _stream(
        tokenizer, _ids(tokenizer, text), SamplingParams(), prompt=_ids(tokenizer, "Say:")
    )
    assert "".join(deltas) == text


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    token_ids = [*_ids(tokenizer, "Hi"), IM_END_ID, *_ids(tokenizer, "\nBye"), END_OF_TEXT_ID]
    for skip, expected in ((True, "Hi\nBye"), (False, "Hi<|im_end|>\nBye<|end_of_text|>")):
        _, deltas, _ = _stream(tokenizer, token_ids, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == expected


def test_window_stays_small_over_long_outputs(tokenizer: Tokenizer) -> None:
    """Each update decodes a bounded window, so the cost per token does not grow with the output."""
    token_ids = _ids(tokenizer, "Streaming 日本語 and emoji 🚀 for a long time. " * 100)
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID], SamplingParams())
    for token_id in token_ids:
        detokenizer.update([token_id], stop_terminated=False)
        assert len(detokenizer._window_ids) <= 8
    assert detokenizer.get_next_output_text(finished=True, delta=False) == tokenizer.decode(
        token_ids
    )


# ---------------------------------------------------------------------------------------------------- stop strings
def test_stop_string_spanning_token_boundaries(tokenizer: Tokenizer) -> None:
    text = "Hello world, stop here please"
    token_ids = _ids(tokenizer, text)
    stop = "op he"
    assert not any(stop in decode_token(tokenizer, token_id) for token_id in token_ids)
    for include, expected in ((False, "Hello world, st"), (True, "Hello world, stop he")):
        detokenizer, deltas, stop_string = _stream(
            tokenizer, token_ids, SamplingParams(stop=[stop], include_stop_str_in_output=include)
        )
        assert stop_string == stop == detokenizer.stop_string
        assert "".join(deltas) == expected == detokenizer.output_text
        assert detokenizer.get_next_output_text(finished=True, delta=False) == expected
        assert detokenizer.num_output_tokens < len(token_ids)  # stopped before the end


def test_stop_string_at_the_very_start(tokenizer: Tokenizer) -> None:
    token_ids = _ids(tokenizer, "Hello world")
    for include, expected in ((False, ""), (True, "Hello")):
        _, deltas, stop_string = _stream(
            tokenizer, token_ids, SamplingParams(stop=["Hello"], include_stop_str_in_output=include)
        )
        assert stop_string == "Hello"
        assert "".join(deltas) == expected


def test_stop_string_inside_a_multibyte_character_sequence(tokenizer: Tokenizer) -> None:
    token_ids = _ids(tokenizer, "Weather: ☀️ then 🌧 later")
    _, deltas, stop_string = _stream(tokenizer, token_ids, SamplingParams(stop=["🌧"]))
    assert stop_string == "🌧"
    assert "".join(deltas) == "Weather: ☀️ then "


def test_earliest_completed_stop_string_wins(tokenizer: Tokenizer) -> None:
    token_ids = _ids(tokenizer, "Hello world, goodbye")
    # "lo w" completes before "world" (and before "Hello world"); list order does not matter.
    for stop in (["world", "lo w", "Hello world"], ["Hello world", "lo w", "world"]):
        for chunk_sizes in ([1], [len(token_ids)], [2, 3]):
            _, deltas, stop_string = _stream(
                tokenizer, token_ids, SamplingParams(stop=stop), chunk_sizes=chunk_sizes
            )
            assert (stop_string, "".join(deltas)) == ("lo w", "Hel")
    # Two stop strings ending at the same character: the longer one (earlier start) wins.
    assert find_stop_string("abcdef", 6, ["def", "cdef"]) == ("cdef", 2)
    assert find_stop_string("abcdef", 2, ["abc"]) is None  # entirely in old text: already checked


def test_stop_results_do_not_depend_on_chunking(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "and",
        "then",
        "dog",
        "ran",
        "to",
        "log",
        "by",
        "bog",
        "日本",
        "🚀",
    ]
    for _ in range(60):
        text = " ".join(rng.choice(words) for _ in range(12))
        token_ids = _ids(tokenizer, text)
        stop = [
            text[start : start + rng.randint(1, 6)]
            for start in (rng.randrange(len(text)) for _ in range(2))
        ]
        stop = [s for s in stop if s.strip()] or ["zzz"]
        include = rng.random() < 0.5
        results = set()
        for chunk_sizes in ([1], [3], [len(token_ids)], [1, 2, 5]):
            _, deltas, stop_string = _stream(
                tokenizer,
                token_ids,
                SamplingParams(stop=stop, include_stop_str_in_output=include),
                chunk_sizes=chunk_sizes,
            )
            results.add((stop_string, "".join(deltas)))
        assert len(results) == 1, (text, stop, results)


def test_partial_stop_string_is_held_back(tokenizer: Tokenizer) -> None:
    stop = "<END>"
    text = "alpha <EN beta <E gamma <END> delta"
    token_ids = _ids(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID], SamplingParams(stop=[stop]))
    shown = ""
    stop_string = None
    for token_id in token_ids:
        stop_string = detokenizer.update([token_id], stop_terminated=False)
        delta = detokenizer.get_next_output_text(finished=stop_string is not None, delta=True)
        shown += delta
        full = detokenizer.output_text
        assert len(full) - len(shown) <= len(stop) - 1
        assert stop not in shown and shown == full[: len(shown)]
        if stop_string is None:
            # the unreleased tail is exactly the held-back buffer (or everything, while it is shorter)
            assert shown == full[: max(len(full) - (len(stop) - 1), 0)]
        else:
            break
    assert stop_string == stop
    assert (
        shown == "alpha <EN beta <E gamma "
    )  # false starts are released once they cannot be a stop


def test_hold_back_is_released_on_finish_without_a_match(tokenizer: Tokenizer) -> None:
    token_ids = _ids(tokenizer, "ends with <EN")
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID], SamplingParams(stop=["<END>"]))
    assert detokenizer.update(token_ids, stop_terminated=False) is None
    assert (
        detokenizer.get_next_output_text(finished=False, delta=True) == "ends with"
    )  # 4 characters held
    assert detokenizer.get_next_output_text(finished=True, delta=True) == " <EN"


def test_delta_and_cumulative_text(tokenizer: Tokenizer) -> None:
    text = "one two three four five six"
    token_ids = _ids(tokenizer, text)
    params = SamplingParams(stop=["seven"])
    cumulative_detok = IncrementalDetokenizer(tokenizer, [BOS_ID], params)
    delta_detok = IncrementalDetokenizer(tokenizer, [BOS_ID], params)
    deltas = []
    for index, token_id in enumerate(token_ids):
        finished = index == len(token_ids) - 1
        cumulative_detok.update([token_id], False)
        delta_detok.update([token_id], False)
        cumulative = cumulative_detok.get_next_output_text(finished, delta=False)
        deltas.append(delta_detok.get_next_output_text(finished, delta=True))
        assert cumulative == "".join(deltas)
        if not finished:
            assert cumulative == text[: len(cumulative)]
            assert len(cumulative) == max(len(cumulative_detok.output_text) - 4, 0)
    assert "".join(deltas) == text
    assert delta_detok.get_next_output_text(finished=True, delta=True) == ""  # nothing new


def test_no_hold_back_when_stop_is_included(tokenizer: Tokenizer) -> None:
    token_ids = _ids(tokenizer, "abc def")
    detokenizer = IncrementalDetokenizer(
        tokenizer, [BOS_ID], SamplingParams(stop=["xyz"], include_stop_str_in_output=True)
    )
    detokenizer.update(token_ids, False)
    assert detokenizer.get_next_output_text(finished=False, delta=False) == "abc def"


def test_stop_strings_ignored_within_min_tokens(tokenizer: Tokenizer) -> None:
    token_ids = _ids(tokenizer, "stop here and stop again")
    first_stop_tokens = len(_ids(tokenizer, "stop"))
    params = SamplingParams(stop=["stop"], min_tokens=first_stop_tokens, max_tokens=64)
    _, deltas, stop_string = _stream(tokenizer, token_ids, params)
    assert stop_string == "stop"
    assert "".join(deltas) == "stop here and "


# ---------------------------------------------------------------------------------------------------- stop tokens
def test_stop_token_text_is_dropped_unless_included(tokenizer: Tokenizer) -> None:
    token_ids = [*_ids(tokenizer, "Answer: 42"), IM_END_ID]
    for include, expected in ((False, "Answer: 42"), (True, "Answer: 42<|im_end|>")):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detokenizer, deltas, stop_string = _stream(
            tokenizer, token_ids, params, stop_terminated=True
        )
        assert stop_string is None
        assert "".join(deltas) == expected
        assert detokenizer.num_output_tokens == len(token_ids)
    # a non-special stop token id (e.g. "." in stop_token_ids) behaves the same way
    token_ids = _ids(tokenizer, "Done.")
    _, deltas, _ = _stream(
        tokenizer,
        token_ids,
        SamplingParams(stop_token_ids=[token_ids[-1]]),
        chunk_sizes=[len(token_ids)],
        stop_terminated=True,
    )
    assert "".join(deltas) == tokenizer.decode(token_ids[:-1])


def test_stop_string_in_the_same_update_as_a_stop_token(tokenizer: Tokenizer) -> None:
    token_ids = [*_ids(tokenizer, "abc STOP xyz"), IM_END_ID]
    _, deltas, stop_string = _stream(
        tokenizer,
        token_ids,
        SamplingParams(stop=["STOP"]),
        chunk_sizes=[len(token_ids)],
        stop_terminated=True,
    )
    assert (stop_string, "".join(deltas)) == ("STOP", "abc ")


def test_updates_after_a_stop_are_ignored(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID], SamplingParams(stop=["b"]))
    assert detokenizer.update(_ids(tokenizer, "a b c"), False) == "b"
    assert detokenizer.update(_ids(tokenizer, " more b"), False) is None
    assert detokenizer.get_next_output_text(finished=True, delta=False) == "a "


# ---------------------------------------------------------------------------------------------------- helpers
def test_decode_token(tokenizer: Tokenizer) -> None:
    assert decode_token(tokenizer, IM_END_ID) == "<|im_end|>"
    assert decode_token(tokenizer, _ids(tokenizer, " world")[0]).startswith(" ")
    rocket_first_byte = _ids(tokenizer, "🚀")[0]
    assert decode_token(tokenizer, rocket_first_byte) == "\ufffd"


def test_works_with_a_loaded_path(tmp_path: Path, tokenizer: Tokenizer) -> None:
    # A tokenizer without special-token configuration still detokenizes (specials are still marked special).
    (tmp_path / "tokenizer.json").write_text(tokenizer.backend.to_str())
    bare = load_tokenizer(tmp_path)
    token_ids = [*_ids(tokenizer, "x"), IM_END_ID]
    _, deltas, _ = _stream(bare, token_ids, SamplingParams())
    assert "".join(deltas) == "x"


# ---------------------------------------------------------------------------------------------------- cost per token
def test_per_token_work_does_not_grow_with_the_output(tokenizer: Tokenizer) -> None:
    """A long output (thousands of tokens, stop strings armed, one delta read per token) never decodes more than a
    small window of ids per token, and the stop-string search never looks at more than the new text and the
    characters before it where a match could begin: each token costs the same at the start and at the end."""
    decoded_lengths: list[int] = []
    backend = tokenizer.backend

    class CountingBackend:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            decoded_lengths.append(len(ids))
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(7)
    token_ids = [rng.randrange(1000) for _ in range(6000)]
    params = SamplingParams(stop=["\x00never\x00", "zz"], max_tokens=10)
    detokenizer = IncrementalDetokenizer(tokenizer, [BOS_ID], params)
    detokenizer._backend = CountingBackend()  # type: ignore[assignment]
    windows: list[int] = []
    deltas = []
    for token_id in token_ids:
        if detokenizer.update([token_id], False) is not None:
            break
        deltas.append(detokenizer.get_next_output_text(False, delta=True))
        windows.append(len(detokenizer._recent))
    assert len(deltas) > 3000, "the random text must not stop early"
    assert max(decoded_lengths) <= 16
    assert max(windows) <= len("\x00never\x00") - 1
    full = tokenizer.decode(token_ids[: len(deltas)], skip_special_tokens=True)
    assert "".join(deltas) + detokenizer.get_next_output_text(True, delta=True) == full
