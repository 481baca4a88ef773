"""Speculative decoding with a draft model, through the real engine on real checkpoints (tiny random Llamas made
here): greedy output is token-identical to decoding without speculation, with a draft that agrees with the target
(itself: every draft accepted) and one that mostly does not, under both runner protocols, synchronous and
asynchronous scheduling, chunked prefill, prefix caching, preemption, stop tokens and max_tokens inside a run, and
n > 1; sampled output is distributed as the target's (chi-square over seeded requests on a 16-token vocabulary,
drafts drawn from the draft's own distribution and verified by min(1, p/q)); seeded requests reproduce; a draft that
cannot serve the target is a ValueError naming `speculative_config`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.engine.arg_utils import EngineArgs
from kvflow.testing.hf_checkpoints import load_hf_model, make_tiny_checkpoint

# Chi-square critical values at p = 0.001, by degrees of freedom (no scipy in the environment).
CHI2_CRITICAL_0_001 = {
    10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697,
}  # fmt: skip
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "skip_tokenizer_init": True}
PROMPTS = [
    [5, 17, 99, 3, 42],
    [7, 7, 7, 7, 7, 7, 8],
    [200, 201, 202, 203],
    [1, 9, 12, 300, 301, 5, 6],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_model")
    return {
        "target": make_tiny_checkpoint(root / "target", "llama", seed=0),
        # The target without its last layer (an early exit): it agrees with the target now and then, so
        # drafts are both accepted and rejected.
        "draft": early_exit_draft(root / "target_for_draft", root / "draft"),
        "other_vocab": make_tiny_checkpoint(root / "other", "llama", seed=2, vocab_size=320),
        "small_target": make_tiny_checkpoint(
            root / "small_target", "llama", seed=3, vocab_size=16, initializer_range=0.05
        ),
        "small_draft": make_tiny_checkpoint(
            root / "small_draft", "llama", seed=4, vocab_size=16, initializer_range=0.05
        ),
    }


def early_exit_draft(target: Path, out: Path) -> Path:
    """A copy of a fresh tiny target checkpoint (seed 0) keeping only its first decoder layer."""
    make_tiny_checkpoint(target, "llama", seed=0)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    tensors = {
        name: tensor
        for name, tensor in load_file(target / "model.safetensors").items()
        if not name.startswith("model.layers.") or name.startswith("model.layers.0.")
    }
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def draft_config(path: Path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(choice.token_ids) for choice in output.outputs] for output in results]


def spec_stats(llm: LLM) -> Any:
    return llm.engine_core_client.run(lambda core: core.scheduler.make_stats()).result()


@pytest.fixture(scope="module")
def baseline(checkpoints: dict[str, Path]) -> Iterator[LLM]:
    llm = LLM(str(checkpoints["target"]), **ENGINE)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(
    ("slot_runner", "async_scheduling", "draft"),
    [(True, True, "target"), (True, False, "draft"), (False, True, "draft")],
    ids=["slot-async-self", "slot-sync-other", "persistent-async-other"],
)
def test_greedy_output_is_token_identical(
    checkpoints: dict[str, Path],
    baseline: LLM,
    slot_runner: bool,
    async_scheduling: bool,
    draft: str,
) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    llm = LLM(
        str(checkpoints["target"]),
        **{**ENGINE, "async_scheduling": async_scheduling},
        use_v2_model_runner=slot_runner,
        speculative_config=draft_config(checkpoints[draft]),
    )
    try:
        assert token_ids(llm, PROMPTS, params) == token_ids(baseline, PROMPTS, params)
        stats = spec_stats(llm).spec_decoding_stats
        assert stats.num_drafts > 0
        if draft == "target":  # the target drafting for itself: every draft is its own argmax
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        else:
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        # max_tokens and a stop token inside an accepted run end the output exactly where plain decoding does.
        stop_params = SamplingParams(
            temperature=0,
            max_tokens=13,
            stop_token_ids=[token_ids(baseline, PROMPTS[:1], params)[0][0][6]],
        )
        assert token_ids(llm, PROMPTS, stop_params) == token_ids(baseline, PROMPTS, stop_params)
        # Logprobs: one entry per token, the target's (as plain decoding's, up to float rounding).
        logprob_params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
        spec_outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], logprob_params, use_tqdm=False
        )
        base_outputs = baseline.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], logprob_params, use_tqdm=False
        )
        for got, want in zip(spec_outputs, base_outputs, strict=True):
            got_out, want_out = got.outputs[0], want.outputs[0]
            assert got_out.token_ids == want_out.token_ids
            assert got_out.logprobs is not None and want_out.logprobs is not None
            assert [
                round(entry[token].logprob, 3)
                for token, entry in zip(got_out.token_ids, got_out.logprobs, strict=True)
            ] == pytest.approx(
                [
                    entry[token].logprob
                    for token, entry in zip(want_out.token_ids, want_out.logprobs, strict=True)
                ],
                abs=2e-3,
            )
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_chunked_prefill_prefix_caching_and_preemption_keep_outputs_exact(
    checkpoints: dict[str, Path], baseline: LLM, async_scheduling: bool
) -> None:
    """A small token budget chunks the prompts (the draft computes each chunk with the target), a small KV cache
    preempts, shared prefixes hit the cache (whose blocks hold the draft's K/V too)."""
    llm = LLM(
        str(checkpoints["target"]),
        **{**ENGINE, "async_scheduling": async_scheduling, "max_model_len": 128},
        max_num_batched_tokens=16,
        num_kv_blocks=24,
        block_size=8,
        speculative_config=draft_config(checkpoints["target"], k=2),
    )
    try:
        prefix = list(range(10, 50))
        prompts = [[*prefix, tail] for tail in (60, 61, 62, 63, 64)]
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        assert token_ids(llm, prompts, params) == token_ids(baseline, prompts, params)
        stats = spec_stats(llm)
        assert stats.num_preemptions_total > 0, "the workload must preempt"
        assert stats.prefix_cache_hit_tokens > 0
        spec = stats.spec_decoding_stats
        assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    finally:
        llm.shutdown()


def exact_marginals(path: Path, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(output token 2 = x) and P(output token 3 = x) under the target at `temperature` (rows 0 and 1),
    summing over the tokens before them: transformers in float32 as the oracle."""
    model = load_hf_model(path)
    vocab = model.config.vocab_size

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].double()
        return torch.softmax(logits / temperature, dim=-1)

    first = next_probs([prompt])[0]
    second = next_probs([[*prompt, a] for a in range(vocab)])  # [a, b]
    pair = first[:, None] * second
    third = next_probs([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
    third_marginal = (pair.reshape(-1, 1) * third).sum(dim=0)
    return torch.stack([pair.sum(dim=0), third_marginal])


def assert_distributed_as(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).double()
    # Pool the cells expected below 5 samples into one (Pearson's approximation needs it).
    expected = probs * len(tokens)
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    assert counts[probs == 0].sum() == 0, "tokens the target never gives"
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    assert statistic < CHI2_CRITICAL_0_001[dof], (
        statistic,
        dof,
        observed.tolist(),
        expected.tolist(),
    )


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampled_output_is_distributed_as_the_target(
    checkpoints: dict[str, Path], method: str
) -> None:
    """1,200 seeded requests: output tokens 2 and 3 (verified with drafts: the first step after the prompt
    proposes them) follow the target's exact marginals, and the proposals are both accepted and rejected: the
    draft model's (q differs from p; min(1, p/q)) and n-gram lookup's (point masses; the prompt repeats its
    tokens, so lookups hit). (Synchronous scheduling: under async scheduling a request's first draft slots come
    one step later; the verification code is the same.)"""
    temperature = 1.5
    prompt = [3, 9, 4, 3, 9, 4, 3]
    spec = (
        draft_config(checkpoints["small_draft"], k=2)
        if method == "draft_model"
        else {
            "method": "ngram",
            "num_speculative_tokens": 2,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        }
    )
    llm = LLM(
        str(checkpoints["small_target"]),
        **{**ENGINE, "max_num_seqs": 64, "async_scheduling": False},
        speculative_config=spec,
    )
    try:
        params = [
            SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=seed)
            for seed in range(1200)
        ]
        results = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
        outputs = [list(result.outputs[0].token_ids) for result in results]
        spec = spec_stats(llm).spec_decoding_stats
    finally:
        llm.shutdown()
    assert all(len(output) == 3 for output in outputs)
    marginals = exact_marginals(checkpoints["small_target"], prompt, temperature)
    assert_distributed_as([output[1] for output in outputs], marginals[0])
    assert_distributed_as([output[2] for output in outputs], marginals[1])
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_requests_reproduce(checkpoints: dict[str, Path], async_scheduling: bool) -> None:
    """A seeded request's drafts and verification draw from (seed, position): alone or in a batch, run again,
    its output is the same."""
    llm = LLM(
        str(checkpoints["target"]),
        **{**ENGINE, "async_scheduling": async_scheduling},
        speculative_config=draft_config(checkpoints["draft"]),
    )
    try:
        params = SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=24, ignore_eos=True)
        alone = token_ids(llm, PROMPTS[:1], params)
        together = token_ids(llm, PROMPTS, params)
        assert together[:1] == alone
        assert token_ids(llm, PROMPTS, params) == together
        spec = spec_stats(llm).spec_decoding_stats
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    finally:
        llm.shutdown()


def test_a_draft_that_cannot_serve_the_target_is_refused(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"speculative_config model .* vocabulary of 320 tokens"):
        LLM(
            str(checkpoints["target"]),
            **ENGINE,
            speculative_config=draft_config(checkpoints["other_vocab"]),
        )
    with pytest.raises(
        ValueError, match="speculative_config method 'draft_model' runs with tensor_parallel"
    ):
        EngineArgs(
            model=str(checkpoints["target"]),
            tensor_parallel_size=2,
            speculative_config=draft_config(checkpoints["draft"]),
        )
    with pytest.raises(ValueError, match="speculative_config method 'draft_model' needs 'model'"):
        EngineArgs(
            model=str(checkpoints["target"]),
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2},
        )
