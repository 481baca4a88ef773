"""kvflow's Gemma 2 against transformers (float32) on a tiny random checkpoint made with `Gemma2ForCausalLM`.

The checkpoint has four layers alternating sliding-window (8) and full attention, `query_pre_attn_scalar` unlike
`head_dim`, and its q/k weights scaled up so the attention soft-cap changes most argmaxes (checked here) and the
final soft-cap bounds the logits. Everything runs through the real paged layout (`paged_model_driver`) on both
attention backends ("cpu" attends every soft-capped row, prompt and decode, in its C++ kernel), then through `LLM`
with both runner protocols and sync and async scheduling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_suite import (
    Checkpoint,
    FamilySuite,
    assert_argmax_equal,
    random_prompt,
    save_random_checkpoint,
)
from paged_model_driver import PagedDriver

from kvflow.kernels import load_cpu_kernels
from kvflow.models.attention.cpu_paged import CpuPagedMetadata
from kvflow.models.gemma2 import Gemma2ForCausalLM
from kvflow.models.hf_config import parse_hf_config
from kvflow.models.loader import load_model
from kvflow.testing.hf_checkpoints import hf_logits, load_hf_model

VOCAB_SIZE = 384
SLIDING_WINDOW = 8


def make_gemma2_checkpoint(path: Path, *, seed: int = 7) -> Path:
    """A tiny float32 Gemma 2 checkpoint: norms perturbed from their zero init, q/k weights x4, final norm +1."""
    import transformers

    config = transformers.Gemma2Config(
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
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0,
    )
    return save_random_checkpoint(
        path,
        lambda: transformers.AutoModelForCausalLM.from_config(config),
        seed=seed,
        scaled=lambda name: "q_proj" in name or "k_proj" in name,
        final_norm=lambda weight: weight.add_(1.0),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_gemma2_checkpoint(tmp_path_factory.mktemp("gemma2"))
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module", params=["torch", "cpu"])
def model(request: pytest.FixtureRequest, checkpoint: Checkpoint) -> Gemma2ForCausalLM:
    loaded = load_model(checkpoint.path, attention_backend=request.param)
    assert isinstance(loaded, Gemma2ForCausalLM)
    return loaded


def _prompt(seed: int, length: int) -> list[int]:
    return random_prompt(seed, length, VOCAB_SIZE)


def test_config_parsing() -> None:
    """transformers' Gemma2Config defaults apply to keys a hub config.json leaves out (tied embeddings, every even
    layer sliding, the soft-caps, `query_pre_attn_scalar`); `hidden_activation` is the MLP's activation."""
    raw = {
        "architectures": ["Gemma2ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "head_dim": 16,
        "sliding_window": 4096,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
    }
    config = parse_hf_config(raw)
    assert config.tie_word_embeddings
    assert [config.layer_sliding_window(i) for i in range(3)] == [4096, None, 4096]
    assert (config.query_pre_attn_scalar, config.attn_logit_softcapping) == (256.0, 50.0)
    assert config.final_logit_softcapping == 30.0
    assert config.hidden_act == "gelu_pytorch_tanh"
    no_caps = parse_hf_config(
        {**raw, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    )
    assert no_caps.attn_logit_softcapping is None and no_caps.final_logit_softcapping is None


def test_checkpoint_exercises_soft_capping(checkpoint: Checkpoint) -> None:
    """Without the attention soft-cap transformers' own argmaxes change: the comparisons below test it."""
    model = load_model(checkpoint.path, attention_backend="torch")
    assert model.layer_windows == [SLIDING_WINDOW, None, SLIDING_WINDOW, None]
    prompt = _prompt(1, 20)
    reference = checkpoint.reference
    capped = checkpoint.logits(prompt)
    layers = reference.model.layers
    saved = [layer.self_attn.attn_logit_softcapping for layer in layers]
    try:
        for layer in layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = checkpoint.logits(prompt)
    finally:
        for layer, cap in zip(layers, saved, strict=True):
            layer.self_attn.attn_logit_softcapping = cap
    assert int((capped.argmax(-1) != uncapped.argmax(-1)).sum()) >= 3
    assert float(capped.abs().max()) < 4.0  # the final soft-cap


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bfloat16_matches_transformers_bfloat16(checkpoint: Checkpoint, backend: str) -> None:
    """In bfloat16 the model (torch backend) stays much closer to transformers in bfloat16 than that is to float32;
    the "cpu" backend's kernel, which keeps attention scores in float32, is on average no farther from float32."""
    prompt = _prompt(13, 29)
    model = load_model(checkpoint.path, dtype="bfloat16", attention_backend=backend)
    driver = PagedDriver(model, block_size=4, seed=13)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [29])
    reference = hf_logits(
        checkpoint.path, prompt, load_hf_model(checkpoint.path, dtype=torch.bfloat16)
    )
    error_vs_bfloat16 = float((logits - reference).abs().max())
    bfloat16_error = float((reference - checkpoint.logits(prompt)).abs().max())
    # torch rounds scores and probabilities to bfloat16 as transformers' eager attention does; the C++ kernel
    # keeps them in float32: its own rounding, on average no farther from float32
    if backend == "torch":
        assert error_vs_bfloat16 <= 0.5 * bfloat16_error, (error_vs_bfloat16, bfloat16_error)
    else:
        error_vs_float32 = float((logits - checkpoint.logits(prompt)).abs().mean())
        mean_bfloat16_error = float((reference - checkpoint.logits(prompt)).abs().mean())
        assert error_vs_float32 <= mean_bfloat16_error, (error_vs_float32, mean_bfloat16_error)


def test_cpu_backend_soft_caps_in_its_kernel(checkpoint: Checkpoint) -> None:
    """The "cpu" backend gives every row of a Gemma 2 step, sliding and full layers, prompt chunks and decode
    rows, to its C++ kernel (no torch group is left), and the logits are transformers'."""
    if load_cpu_kernels() is None:
        pytest.skip("CPU kernels disabled or not built on this machine")
    model = load_model(checkpoint.path, attention_backend="cpu")
    prompt = _prompt(21, 41)
    driver = PagedDriver(model, block_size=4, seed=21)
    driver.add_request("a", prompt)
    logits = []
    # a chunk longer than the short-query limit, a one-token row, a continuation
    for chunk in (25, 1, 15):
        batch, chunk_logits = driver.step({"a": chunk}, all_logits=True)
        logits.append(chunk_logits)
        for window in (SLIDING_WINDOW, None):
            metadata = model.attention_backend.build_metadata(batch, window)
            assert isinstance(metadata, CpuPagedMetadata) and metadata.kernel is not None
            assert metadata.torch_plan.decode is None and not metadata.torch_plan.prefills
    assert_argmax_equal(torch.cat(logits), checkpoint.logits(prompt))


class TestGemma2Family(FamilySuite):
    """The checks every family's comparison with transformers makes (`family_suite`)."""

    vocab_size = VOCAB_SIZE
