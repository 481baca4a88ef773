"""`LLM` on the built-in default model: text in, text out, stop strings, logprobs, n > 1, seeds, chat."""

from __future__ import annotations

import itertools
import math
import pathlib

import pytest

from kvflow import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, num_kv_blocks=512, max_num_seqs=16)


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def test_default_model_generates_text_that_decodes_its_tokens(llm: LLM) -> None:
    [output] = llm.generate(PROMPT, greedy(max_tokens=24), use_tqdm=False)
    completion = output.outputs[0]
    assert output.prompt == PROMPT
    assert output.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    assert len(completion.token_ids) == 24 and completion.finish_reason == "length"
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    assert completion.text  # the random model still produces characters


def test_stop_string_truncates_text_and_stops_generation(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(max_tokens=40), use_tqdm=False)[0].outputs[0]
    stop = full.text[10:13]
    assert len(stop) == 3
    first_match = full.text.index(stop)
    stopped = llm.generate(PROMPT, greedy(max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.text == full.text[:first_match]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert (
        full.token_ids[: len(stopped.token_ids)] == stopped.token_ids
    )  # generation ended at the match
    assert len(stopped.token_ids) < len(full.token_ids)
    kept = llm.generate(
        PROMPT, greedy(max_tokens=40, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: first_match + len(stop)]
    assert not llm.run_in_engine(
        lambda core: core.scheduler.has_unfinished_requests()
    )  # stopped requests were aborted in the core


def test_logprobs_hold_the_sampled_token_and_the_top_alternatives(llm: LLM) -> None:
    completion = llm.generate(PROMPT, greedy(max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[
        0
    ]
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    total = 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert (
            token_id in position and position[token_id].rank == 1
        )  # greedy picks the most likely token
        assert len(position) == 3  # the sampled token is also the top-1 alternative
        ranked = sorted(position.values(), key=lambda logprob: logprob.rank or 0)
        assert [logprob.rank for logprob in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(ranked))
        assert all(logprob.logprob <= 0 and logprob.decoded_token is not None for logprob in ranked)
        total += position[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    assert math.exp(total) > 0


def test_n_samples_share_the_prompt_and_seeds_make_them_reproducible(llm: LLM) -> None:
    long_prompt = PROMPT * 4
    single = llm.generate(long_prompt, greedy(max_tokens=8), use_tqdm=False)[0].outputs[0]
    llm.reset_prefix_cache()
    [parallel] = llm.generate(long_prompt, greedy(max_tokens=8, n=3), use_tqdm=False)
    assert [c.index for c in parallel.outputs] == [0, 1, 2]
    assert all(c.token_ids == single.token_ids for c in parallel.outputs)
    assert (
        parallel.metrics is not None and parallel.metrics.num_cached_tokens > 0
    )  # later samples hit the cache

    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(PROMPT, sampled, use_tqdm=False)[0].outputs]
    again = [
        c.token_ids
        for c in llm.generate([PROMPT, "unrelated neighbour"], sampled, use_tqdm=False)[0].outputs
    ]
    assert first == again  # same seed, different batch: same tokens
    assert len({tuple(tokens) for tokens in first}) > 1  # each sample gets its own seed


def test_seeded_request_is_independent_of_its_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=12, ignore_eos=True)
    batch = llm.generate(["a", PROMPT, "b c d"], [others, params, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    [output] = llm.chat(messages, greedy(max_tokens=5), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert output.prompt == rendered and "You are terse." in rendered
    assert output.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert len(output.outputs[0].token_ids) == 5
    two = llm.chat(
        [messages, [{"role": "user", "content": "Again"}]], greedy(max_tokens=2), use_tqdm=False
    )
    assert len(two) == 2


def test_chat_reads_a_template_file_and_continues_a_final_message(
    llm: LLM, tmp_path: pathlib.Path
) -> None:
    """`chat_template` naming a file renders that file (it once rendered the path itself as the prompt), with
    `chat_template_kwargs`; `continue_final_message` continues the assistant's text with no new turn."""
    template = tmp_path / "real.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{{ flavour }}{% endif %}"
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    [output] = llm.chat(
        messages,
        greedy(max_tokens=2),
        use_tqdm=False,
        chat_template=str(template),
        chat_template_kwargs={"flavour": " mint"},
    )
    assert output.prompt == "[user] Hi!\n[assistant] mint"
    continued = [*messages, {"role": "assistant", "content": "Once upon"}]
    [output] = llm.chat(
        continued,
        greedy(max_tokens=2),
        use_tqdm=False,
        chat_template=template,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert output.prompt == "[user] Hi!\n[assistant] Once upon"
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(messages, use_tqdm=False, chat_template="missing.jinja")


def test_token_id_prompts_and_bad_inputs(llm: LLM) -> None:
    token_ids = llm.get_tokenizer().encode(PROMPT)
    by_ids = llm.generate({"prompt_token_ids": token_ids}, greedy(max_tokens=5), use_tqdm=False)[0]
    by_text = llm.generate(PROMPT, greedy(max_tokens=5), use_tqdm=False)[0]
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids and by_ids.prompt is None
    with pytest.raises(ValueError, match="prompt_token_ids holds"):
        llm.generate({"prompt_token_ids": [llm.vocab_size]}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=512"):
        llm.generate({"prompt_token_ids": [5] * 512}, use_tqdm=False)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)
    assert not llm.run_in_engine(lambda core: core.scheduler.has_unfinished_requests())


def test_skip_tokenizer_init_is_token_ids_only() -> None:
    llm = LLM(skip_tokenizer_init=True, max_model_len=128, num_kv_blocks=64, max_num_seqs=2)
    output = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(max_tokens=3), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 3 and output.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", use_tqdm=False)


def test_max_model_len_beyond_the_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="larger than the model supports"):
        LLM(max_model_len=10**6)
