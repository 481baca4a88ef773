"""kvflow's Gemma 3 (text) against transformers (float32) on a tiny random checkpoint made with `Gemma3ForCausalLM`.

The checkpoint has four layers (local, global, local, local: sliding window 8), local and global RoPE bases far apart
and global linear rope scaling, `query_pre_attn_scalar` unlike `head_dim`, perturbed q/k norms and a final soft-cap.
Everything runs through the real paged layout (`paged_model_driver`) on both attention backends, then through `LLM`
with both runner protocols and sync and async scheduling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_suite import (
    Checkpoint,
    FamilySuite,
    TensorParallelSuite,
    random_prompt,
    save_random_checkpoint,
)
from paged_model_driver import PagedDriver

from kvflow.models.gemma3 import Gemma3ForCausalLM
from kvflow.models.hf_config import parse_hf_config
from kvflow.models.loader import load_model
from kvflow.testing.hf_checkpoints import hf_logits, load_hf_model

VOCAB_SIZE = 384
SLIDING_WINDOW = 8


def make_gemma3_checkpoint(path: Path, *, seed: int = 7) -> Path:
    """A tiny float32 Gemma 3 text checkpoint: norms perturbed from their zero init, q/k weights x4, final norm +1."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        sliding_window=SLIDING_WINDOW,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        rope_theta=1_000_000.0,
        rope_local_base_freq=10.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        query_pre_attn_scalar=24,
        final_logit_softcapping=6.0,
    )
    return save_random_checkpoint(
        path,
        lambda: transformers.Gemma3ForCausalLM(config),
        seed=seed,
        scaled=lambda name: "q_proj" in name or "k_proj" in name,
        final_norm=lambda weight: weight.add_(1.0),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module", params=["torch", "cpu"])
def model(request: pytest.FixtureRequest, checkpoint: Checkpoint) -> Gemma3ForCausalLM:
    loaded = load_model(checkpoint.path, attention_backend=request.param)
    assert isinstance(loaded, Gemma3ForCausalLM)
    return loaded


def _prompt(seed: int, length: int) -> list[int]:
    return random_prompt(seed, length, VOCAB_SIZE)


def test_config_parsing() -> None:
    """transformers' Gemma3TextConfig defaults apply to keys a hub config.json leaves out (tied embeddings, every
    sixth layer global, no soft-caps, window 4096, rope bases 1e6 / 1e4); transformers 4's keys (`rope_theta`,
    `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) and 5's per-layer-type `rope_parameters` read
    alike."""
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 7,
        "num_attention_heads": 2,
        "head_dim": 16,
    }
    config = parse_hf_config(raw)
    assert config.tie_word_embeddings and config.qk_norm
    windows = [config.layer_sliding_window(i) for i in range(7)]
    assert windows == [4096] * 5 + [None, 4096]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (None, None)
    assert (config.rope_theta, config.sliding_rope_theta, config.rope_scaling) == (1e6, 1e4, None)
    assert config.query_pre_attn_scalar == 256.0 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.max_position_embeddings == 131_072
    old = parse_hf_config(
        {
            **raw,
            "sliding_window": 512,
            "sliding_window_pattern": 2,
            "rope_theta": 5e5,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "final_logit_softcapping": 30.0,
        }
    )
    new = parse_hf_config(
        {
            **raw,
            "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
            },
            "final_logit_softcapping": 30.0,
        }
    )
    assert old == new
    assert [old.layer_sliding_window(i) for i in range(7)] == [512, None] * 3 + [512]
    assert (old.rope_theta, old.sliding_rope_theta) == (5e5, 100.0)
    assert old.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert old.final_logit_softcapping == 30.0
    with pytest.raises(ValueError, match="bidirectional"):
        parse_hf_config({**raw, "use_bidirectional_attention": True})


def test_checkpoint_exercises_local_rope_and_qk_norm(checkpoint: Checkpoint) -> None:
    """The local layers' rope base and the q/k norms change transformers' own argmaxes: the comparisons below
    test both."""
    model = load_model(checkpoint.path, attention_backend="torch")
    assert model.layer_windows == [SLIDING_WINDOW, None, SLIDING_WINDOW, SLIDING_WINDOW]
    prompt = _prompt(1, 40)
    reference = checkpoint.reference
    logits = checkpoint.logits(prompt)
    rotary = reference.model.rotary_emb
    saved = rotary.sliding_attention_inv_freq.clone()
    try:
        rotary.sliding_attention_inv_freq.copy_(rotary.full_attention_inv_freq)
        same_rope = checkpoint.logits(prompt)
    finally:
        rotary.sliding_attention_inv_freq.copy_(saved)
    assert int((logits.argmax(-1) != same_rope.argmax(-1)).sum()) >= 3
    norm = reference.model.layers[1].self_attn.k_norm.weight
    saved = norm.detach().clone()
    try:
        with torch.no_grad():
            norm.zero_()
        plain_norm = checkpoint.logits(prompt)
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    assert int((logits.argmax(-1) != plain_norm.argmax(-1)).sum()) >= 3
    assert float(logits.abs().max()) < 6.0  # the final soft-cap


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bfloat16_matches_transformers_bfloat16(checkpoint: Checkpoint, backend: str) -> None:
    """In bfloat16 the model (torch backend) stays much closer to transformers in bfloat16 than that is to float32,
    on average (the largest difference is not a fair measure here: transformers rounds the logits to bfloat16
    before the final soft-cap, kvflow caps float32 logits, and that rounding alone is ~1 ulp at |logit| near the
    cap of 6). The "cpu" backend's kernel keeps attention scores in float32: on average no farther from float32."""
    prompt = _prompt(13, 29)
    model = load_model(checkpoint.path, dtype="bfloat16", attention_backend=backend)
    driver = PagedDriver(model, block_size=4, seed=13)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [29])
    reference = hf_logits(
        checkpoint.path, prompt, load_hf_model(checkpoint.path, dtype=torch.bfloat16)
    )
    error_vs_bfloat16 = float((logits - reference).abs().mean())
    bfloat16_error = float((reference - checkpoint.logits(prompt)).abs().mean())
    # torch rounds scores and probabilities to bfloat16 as transformers' eager attention does; the C++ kernel
    # keeps them in float32: its own rounding, on average no farther from float32
    if backend == "torch":
        assert error_vs_bfloat16 <= 0.5 * bfloat16_error, (error_vs_bfloat16, bfloat16_error)
    else:
        error_vs_float32 = float((logits - checkpoint.logits(prompt)).abs().mean())
        mean_bfloat16_error = float((reference - checkpoint.logits(prompt)).abs().mean())
        assert error_vs_float32 <= mean_bfloat16_error, (error_vs_float32, mean_bfloat16_error)


class TestGemma3Family(FamilySuite, TensorParallelSuite):
    """The checks every family's comparison with transformers makes (`family_suite`)."""

    vocab_size = VOCAB_SIZE
