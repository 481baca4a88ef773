"""Speculative decoding (n-gram drafts) through the real engine: greedy output is token-identical to decoding
without speculation, and so is seeded sampling (each verification row samples with its position's seed in the
context of the drafts before it, exactly what plain decoding samples there), on the built-in model and the hash
model, with both runner protocols, synchronous and asynchronous scheduling, chunked prefill, prefix caching,
preemption, stop strings and max_tokens inside an accepted run, and n > 1. The scheduler's counters show drafts
were proposed and accepted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.testing.hash_model import reference_tokens

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}
# The built-in model loops on these, so n-gram drafts from its own output are accepted often.
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "She said: the two ladies, the two ladies, the two ladies,",
    "A computer program is",
]
ENGINE = {"max_model_len": 256, "max_num_seqs": 4}


def outputs(llm: LLM | Plain, prompts: list[Any], params: SamplingParams) -> list[list[list[int]]]:
    results = (
        llm.generate(prompts, params)
        if isinstance(llm, Plain)
        else llm.generate(prompts, params, use_tqdm=False)
    )
    return [[list(choice.token_ids) for choice in output.outputs] for output in results]


def spec_stats(llm: LLM) -> Any:
    return scheduler_stats(llm).spec_decoding_stats


def scheduler_stats(llm: LLM) -> Any:
    return llm.engine_core_client.run(lambda core: core.scheduler.make_stats()).result()


class Plain:
    """The engine without speculation, its outputs remembered per (prompts, params): every speculating variant
    compares against the same baseline run."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._outputs: dict[str, Any] = {}

    def generate(self, prompts: list[Any], params: SamplingParams) -> Any:
        key = repr((prompts, params))
        if key not in self._outputs:
            self._outputs[key] = self.llm.generate(prompts, params, use_tqdm=False)
        return self._outputs[key]


@pytest.fixture(scope="module")
def plain() -> Iterator[Plain]:
    llm = LLM(**ENGINE)
    yield Plain(llm)
    llm.shutdown()


@pytest.fixture(
    scope="module",
    # (persistent-batch with sync scheduling: tests/engine/test_spec_decode_interleavings.py and the exhaustive
    # checker cover it; the suite's time budget keeps three variants here)
    params=[(True, True), (True, False), (False, True)],
    ids=["slot-async", "slot-sync", "persistent-async"],
)
def speculating(request: pytest.FixtureRequest) -> Iterator[LLM]:
    slot_runner, async_scheduling = request.param
    llm = LLM(
        **{**ENGINE, "async_scheduling": async_scheduling},
        speculative_config=NGRAM,
        use_v2_model_runner=slot_runner,
    )
    yield llm
    llm.shutdown()


def test_greedy_output_is_token_identical_and_drafts_are_accepted(
    plain: Plain, speculating: LLM
) -> None:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert outputs(speculating, PROMPTS, params) == outputs(plain, PROMPTS, params)
    stats = spec_stats(speculating)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_seeded_sampling_is_identical_with_n_and_penalties(plain: Plain, speculating: LLM) -> None:
    params = SamplingParams(
        temperature=0.8, top_p=0.95, seed=7, n=2, max_tokens=24, repetition_penalty=1.1
    )
    assert outputs(speculating, PROMPTS[2:], params) == outputs(plain, PROMPTS[2:], params)


@pytest.mark.parametrize("max_tokens", [1, 21])
def test_max_tokens_and_stop_strings_inside_an_accepted_run(
    plain: Plain, speculating: LLM, max_tokens: int
) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=["ladies,"])
    spec = speculating.generate(PROMPTS, params, use_tqdm=False)
    base = plain.generate(PROMPTS, params)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in spec] == [
        (o.outputs[0].text, o.outputs[0].finish_reason) for o in base
    ]
    assert all(len(o.outputs[0].token_ids) <= max_tokens for o in spec)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_chunked_prefill_prefix_caching_and_preemption_keep_outputs_exact(
    plain: Plain, async_scheduling: bool
) -> None:
    """A small token budget chunks the prompts, a small KV cache preempts (with drafts in flight, under async
    scheduling: their steps are discarded whole), shared prefixes hit the cache."""
    llm = LLM(
        max_model_len=128,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        num_kv_blocks=16,
        block_size=8,
        speculative_config=NGRAM,
    )
    try:
        prefix = "the two ladies, the two ladies, " * 3
        prompts = [prefix + tail for tail in ("and", "but", "so", "then", "yet")]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        assert outputs(llm, prompts, params) == outputs(plain, prompts, params)
        stats = scheduler_stats(llm)
        assert stats.num_preemptions_total > 0, "the workload must preempt"
        assert stats.prefix_cache_hit_tokens > 0
        assert stats.spec_decoding_stats.num_accepted_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_hash_model_matches_its_oracle_with_drafts_rejected(async_scheduling: bool) -> None:
    """The hash model's tokens are pseudo-random: a draft comes when a sampled token happens to occur in the long
    prompt (deterministically, for these prompts), is rejected, and the rejection rolls back exactly."""
    llm = LLM(
        "hash",
        max_model_len=1536,
        num_kv_blocks=512,
        max_num_seqs=3,
        async_scheduling=async_scheduling,
        speculative_config=NGRAM,
    )
    try:
        prompts = [list(range(start, 50256, 37))[:1200] for start in (0, 11, 23)]
        params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
        got = outputs(llm, [{"prompt_token_ids": p} for p in prompts], params)
        assert got == [[reference_tokens(p, 120)] for p in prompts]
        if not async_scheduling:
            # (Under async scheduling a step's draft slots follow the proposal one step older, and an isolated
            # chance match like these is gone by then: the slots are padding, rejected and rolled back.)
            assert spec_stats(llm).num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_disable_by_batch_size_turns_speculation_off_for_large_batches(plain: Plain) -> None:
    """With `disable_by_batch_size` 2, four requests decoding together verify no drafts (outputs unchanged); one
    request alone speculates again."""
    llm = LLM(
        **ENGINE,
        async_scheduling=False,
        speculative_config={**NGRAM, "disable_by_batch_size": 2},
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        assert outputs(llm, PROMPTS, params) == outputs(plain, PROMPTS, params)
        assert spec_stats(llm).num_drafts == 0
        assert outputs(llm, PROMPTS[2:3], params) == outputs(plain, PROMPTS[2:3], params)
        assert spec_stats(llm).num_accepted_tokens > 0
    finally:
        llm.shutdown()


def test_logprobs_come_per_accepted_token(plain: Plain, speculating: LLM) -> None:
    """A request asking for logprobs speculates too: one entry per token, each the verification row's, equal to
    plain decoding's (the same logits up to float rounding between a multi-token and a one-token pass)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    before = spec_stats(speculating).num_accepted_tokens
    spec = speculating.generate(PROMPTS[2:], params, use_tqdm=False)
    base = plain.generate(PROMPTS[2:], params)
    assert spec_stats(speculating).num_accepted_tokens > before, "no draft was accepted"
    for got, want in zip(spec, base, strict=True):
        got_out, want_out = got.outputs[0], want.outputs[0]
        assert got_out.token_ids == want_out.token_ids
        assert got_out.logprobs is not None and want_out.logprobs is not None
        assert len(got_out.logprobs) == len(got_out.token_ids)
        for token, got_entry, want_entry in zip(
            got_out.token_ids, got_out.logprobs, want_out.logprobs, strict=True
        ):
            assert token in got_entry
            assert set(got_entry) == set(want_entry)
            for token_id, entry in got_entry.items():
                assert entry.logprob == pytest.approx(want_entry[token_id].logprob, abs=1e-3)
                assert entry.rank == want_entry[token_id].rank
        assert got_out.cumulative_logprob == pytest.approx(want_out.cumulative_logprob, abs=1e-2)
