"""kvflow's Llama-family model against transformers (float32) on tiny random checkpoints of every variant.

Everything runs through the real paged layout (`paged_model_driver`): shuffled block ids, one-shot and chunked
prefill, several requests decoded together, prefill chunks mixed with decodes in one step, and prefix blocks
shared between requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_model_driver import PagedDriver

from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import load_model
from kvflow.testing.hf_checkpoints import VARIANTS, hf_greedy, hf_logits, load_hf_model

ATOL = RTOL = 1e-4


@dataclass
class Variant:
    """One tiny checkpoint with the kvflow model and the transformers reference loaded from it."""

    name: str
    path: Path
    model: LlamaForCausalLM
    reference: Any

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return hf_greedy(self.path, prompt, max_new_tokens, self.reference)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return hf_logits(self.path, token_ids, self.reference)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Variant:
    from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=7)
    return Variant(request.param, path, load_model(path), load_hf_model(path))


def _prompt(seed: int, length: int, vocab_size: int = 384) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


def test_prompt_logits_one_shot(variant: Variant) -> None:
    prompt = _prompt(1, 37)
    driver = PagedDriver(variant.model, block_size=4, seed=1)
    driver.add_request("a", prompt)
    torch.testing.assert_close(
        driver.prompt_logits("a", [37]), variant.logits(prompt), atol=ATOL, rtol=RTOL
    )


def test_prompt_logits_chunked(variant: Variant) -> None:
    """Chunks continue the cached KV; chunk edges fall inside and on block boundaries."""
    prompt = _prompt(2, 45)
    driver = PagedDriver(variant.model, block_size=16, seed=2)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [7, 1, 8, 13, 16])
    torch.testing.assert_close(logits, variant.logits(prompt), atol=ATOL, rtol=RTOL)


def test_prompt_logits_with_shared_prefix_blocks(variant: Variant) -> None:
    """Request b starts on request a's first 5 blocks (a prefix-cache hit) and computes only its own tail."""
    prompt_a = _prompt(3, 30)
    prompt_b = prompt_a[:20] + _prompt(4, 11)
    driver = PagedDriver(variant.model, block_size=4, seed=3)
    driver.add_request("a", prompt_a)
    driver.prompt_logits("a", [30])
    driver.add_request("b", prompt_b, share_prefix_from="a", num_shared_blocks=5)
    logits = driver.prompt_logits("b", [11])
    torch.testing.assert_close(logits, variant.logits(prompt_b)[20:], atol=ATOL, rtol=RTOL)


def test_greedy_single_request(variant: Variant) -> None:
    prompt = _prompt(5, 11)
    driver = PagedDriver(variant.model, block_size=4, seed=5)
    outputs = driver.generate({"a": prompt}, max_new_tokens=24)
    assert outputs["a"] == variant.greedy(prompt, 24)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_batch_with_mixed_steps(variant: Variant, block_size: int) -> None:
    """Prompts arrive at different steps and prefill in chunks of 6 while earlier requests decode."""
    prompts = {"a": _prompt(6, 9), "b": _prompt(7, 23), "c": _prompt(8, 3), "d": _prompt(9, 31)}
    driver = PagedDriver(variant.model, block_size=block_size, seed=6)
    outputs = driver.generate(
        prompts, max_new_tokens=16, chunk_size=6, arrival_steps={"c": 2, "d": 4}
    )
    assert any(lens.count(1) >= 2 and max(lens) > 1 for lens in driver.step_query_lens), (
        "no step mixing a prefill chunk with several decodes"
    )
    assert any(lens.count(1) >= 3 for lens in driver.step_query_lens), "no batched decode step"
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == variant.greedy(prompt, 16), req_id


def test_greedy_with_shared_prefix(variant: Variant) -> None:
    """b reuses a's first three full blocks (prompt tokens only) and decodes alongside a."""
    block_size = 4
    prompt_a = _prompt(10, 17)
    prompt_b = prompt_a[:12] + _prompt(11, 6)
    driver = PagedDriver(variant.model, block_size=block_size, seed=7)
    driver.generate({"a": prompt_a}, max_new_tokens=1)
    driver.add_request("b", prompt_b, share_prefix_from="a", num_shared_blocks=3)
    outputs = driver.generate({"a": prompt_a, "b": prompt_b}, max_new_tokens=14)
    assert driver.step_query_lens[1] == [1, 6], (
        "b should compute only its unshared tail, next to a's decode"
    )
    assert outputs["b"] == variant.greedy(prompt_b, 14)
    assert outputs["a"] == variant.greedy(prompt_a, 14)


def test_partial_prefill_returns_no_logits(variant: Variant) -> None:
    driver = PagedDriver(variant.model, block_size=4)
    driver.add_request("a", _prompt(12, 10))
    _, logits = driver.step({"a": 6})
    assert logits.shape == (0, variant.model.vocab_size)


def test_kv_cache_size(variant: Variant) -> None:
    cache = variant.model.make_kv_cache(num_blocks=3, block_size=8)
    config = variant.model.config
    assert cache.shape == (
        config.num_hidden_layers,
        2,
        config.num_key_value_heads,
        3,
        8,
        config.head_dim,
    )
    assert cache.numel() * cache.element_size() == 3 * variant.model.kv_cache_bytes_per_block(8)


def test_bfloat16_matches_transformers_bfloat16(variant: Variant) -> None:
    """In bfloat16 the model stays much closer to transformers in bfloat16 than that is to float32."""
    prompt = _prompt(13, 29)
    model = load_model(variant.path, dtype="bfloat16")
    driver = PagedDriver(model, block_size=4, seed=13)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [29])
    reference = hf_logits(variant.path, prompt, load_hf_model(variant.path, dtype=torch.bfloat16))
    error_vs_bfloat16 = float((logits - reference).abs().max())
    bfloat16_error = float((reference - variant.logits(prompt)).abs().max())
    assert error_vs_bfloat16 <= 0.5 * bfloat16_error, (error_vs_bfloat16, bfloat16_error)


def test_qwen2_sliding_window_on_some_layers(tmp_path: Path) -> None:
    """Qwen2 with `use_sliding_window`: layers past `max_window_layers` slide, the others see everything."""
    from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    model = load_model(path)
    assert [model.config.layer_sliding_window(i) for i in range(2)] == [None, 8]
    reference = load_hf_model(path)
    prompt = _prompt(14, 33)
    driver = PagedDriver(model, block_size=4, seed=14)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [10, 23])
    torch.testing.assert_close(logits, hf_logits(path, prompt, reference), atol=ATOL, rtol=RTOL)
    outputs = PagedDriver(model, block_size=4, seed=15).generate(
        {"b": prompt[:12]}, max_new_tokens=20
    )
    assert outputs["b"] == hf_greedy(path, prompt[:12], 20, reference)
