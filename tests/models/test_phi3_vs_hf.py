"""kvflow's Phi-3 against transformers (float32) on tiny random `Phi3ForCausalLM` checkpoints.

Checkpoints written by transformers' own class: plain RoPE with a sliding window, LongRoPE with a tiny
`original_max_position_embeddings` (32) so both factor sets are reached, and Phi-4-mini's shape (partial rotary:
`partial_rotary_factor` 0.75 with LongRoPE factors for the 12 rotated dims of 16, tied embeddings, 6 query heads on 2
KV heads), once with one factor set (the `family_suite` checks) and once with both. Everything runs through the real
paged layout (`paged_model_driver`): chunked prefill, batched decodes mixed with prefill chunks, prefix blocks shared
between requests; then through `LLM` (sync and async scheduling, both runner protocols) and tensor-parallel loading of
the fused checkpoint tensors.

The LongRoPE rule (`kvflow.models.phi3.LongRopeRotaryEmbedding`): the long factors exactly when the engine's
`max_model_len` exceeds `original_max_position_embeddings`. It matches transformers token for token with a
`max_model_len` at the threshold (every sequence short: short factors) and, above it, on sequences whose prompt is
already past the threshold (transformers uses the long factors from the first forward on).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from family_suite import Checkpoint, FamilySuite, TensorParallelSuite
from paged_model_driver import PagedDriver

from kvflow import LLM, SamplingParams
from kvflow.distributed import TensorParallelGroup
from kvflow.kernels import load_cpu_kernels
from kvflow.models.fused_decode import FusedDecodeLayers
from kvflow.models.hf_config import load_hf_config, parse_hf_config
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import iterate_safetensors_weights, load_model
from kvflow.models.phi3 import LongRopeRotaryEmbedding, Phi3ForCausalLM
from kvflow.testing import hf_checkpoints
from kvflow.testing.hf_checkpoints import load_hf_model

ATOL = RTOL = 1e-4
ORIGINAL_MAX = 32
VOCAB = 384


def make_phi3_checkpoint(path: Path, *, seed: int = 7, **overrides: Any) -> Path:
    """A tiny random Phi-3 checkpoint (`hf_checkpoints`' shape, perturbed norms, wide logit margins)."""
    import transformers

    config = transformers.Phi3Config(
        **{**hf_checkpoints._SMALL_SHAPE, "tie_word_embeddings": False, **overrides}
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        hf_checkpoints._perturb_constant_parameters(model, std=hf_checkpoints._PERTURBED_SCALE)
        with torch.no_grad():
            model.model.norm.weight.mul_(hf_checkpoints._FINAL_NORM_SCALE)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(path)
    return path


def _factors(seed: int, low: float, spread: float, count: int = 8) -> list[float]:
    """LongRoPE factors, one per rotated frequency (head_dim 16, whole heads: 8)."""
    generator = torch.Generator().manual_seed(seed)
    return (low + spread * torch.rand(count, generator=generator)).tolist()


LONGROPE = {
    "max_position_embeddings": 128,
    "original_max_position_embeddings": ORIGINAL_MAX,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": _factors(1, 1.0, 0.1),
        "long_factor": _factors(2, 1.0, 8.0),
    },
}


# Phi-4-mini's shape, scaled down: head_dim 16 of which the first 12 rotate (factor 0.75; Phi-4-mini: 96 of 128), so
# LongRoPE has 6 factors per list; 6 query heads on 2 KV heads (Phi-4-mini: 24 on 8); tied embeddings.
PHI4_MINI_SHAPE = {
    "hidden_size": 96,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "partial_rotary_factor": 0.75,
}
PHI4_ROTARY_DIM = 12
# One factor set for every sequence the suite runs (max_position_embeddings is the original length), with an explicit
# attention factor (Phi-4-mini's default one, sqrt(1 + ln 32 / ln 4096)), so the scaled tables are checked too.
PHI4_MINI = {
    **PHI4_MINI_SHAPE,
    "max_position_embeddings": 64,
    "original_max_position_embeddings": 64,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": _factors(3, 1.0, 0.5, PHI4_ROTARY_DIM // 2),
        "long_factor": _factors(4, 1.0, 8.0, PHI4_ROTARY_DIM // 2),
        "attention_factor": 1.19,
    },
}
# Both factor sets, as `LONGROPE`.
PHI4_MINI_LONG = {
    **PHI4_MINI_SHAPE,
    "max_position_embeddings": 128,
    "original_max_position_embeddings": ORIGINAL_MAX,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": _factors(5, 1.0, 0.1, PHI4_ROTARY_DIM // 2),
        "long_factor": _factors(6, 1.0, 8.0, PHI4_ROTARY_DIM // 2),
    },
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_phi3_checkpoint(tmp_path_factory.mktemp("phi3"), sliding_window=12)
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_phi3_checkpoint(tmp_path_factory.mktemp("phi3_longrope"), seed=8, **LONGROPE)
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_phi3_checkpoint(tmp_path_factory.mktemp("phi4_mini"), seed=9, **PHI4_MINI)
    return Checkpoint(path, load_hf_model(path))


@pytest.fixture(scope="module")
def phi4_mini_long(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = make_phi3_checkpoint(
        tmp_path_factory.mktemp("phi4_mini_long"), seed=10, **PHI4_MINI_LONG
    )
    return Checkpoint(path, load_hf_model(path))


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def _model(path: Path, max_model_len: int | None = None) -> Phi3ForCausalLM:
    model = load_model(path)
    assert isinstance(model, Phi3ForCausalLM)
    if max_model_len is not None:
        model.set_max_model_len(max_model_len)
    return model


# ---------------------------------------------------------------------------------------------- plain RoPE
def test_config_and_layers(plain: Checkpoint) -> None:
    model = _model(plain.path)
    assert [model.config.layer_sliding_window(i) for i in range(2)] == [12, 12]
    # Llama-shaped after loading: the fused rows are q, k, v and gate, up, as a Llama checkpoint's would be.
    fused = dict(iterate_safetensors_weights(plain.path))
    layer = model.model.layers[1]
    assert torch.equal(
        layer.self_attn.qkv_proj.weight, fused["model.layers.1.self_attn.qkv_proj.weight"]
    )
    assert torch.equal(
        layer.mlp.gate_up_proj.weight, fused["model.layers.1.mlp.gate_up_proj.weight"]
    )


def test_prompt_logits_one_shot_and_chunked(plain: Checkpoint) -> None:
    prompt = _prompt(1, 37)
    model = _model(plain.path)
    for block_size, chunks in ((4, [37]), (16, [7, 1, 8, 13, 8])):
        driver = PagedDriver(model, block_size=block_size, seed=block_size)
        driver.add_request("a", prompt)
        logits = driver.prompt_logits("a", chunks)
        torch.testing.assert_close(logits, plain.logits(prompt), atol=ATOL, rtol=RTOL)


def test_prompt_logits_with_shared_prefix_blocks(plain: Checkpoint) -> None:
    prompt_a = _prompt(3, 30)
    prompt_b = prompt_a[:20] + _prompt(4, 11)
    driver = PagedDriver(_model(plain.path), block_size=4, seed=3)
    driver.add_request("a", prompt_a)
    driver.prompt_logits("a", [30])
    driver.add_request("b", prompt_b, share_prefix_from="a", num_shared_blocks=5)
    logits = driver.prompt_logits("b", [11])
    torch.testing.assert_close(logits, plain.logits(prompt_b)[20:], atol=ATOL, rtol=RTOL)


def test_greedy_batch_with_mixed_steps(plain: Checkpoint) -> None:
    """Prompts arrive at different steps and prefill in chunks of 6 while earlier requests decode."""
    prompts = {"a": _prompt(6, 9), "b": _prompt(7, 23), "c": _prompt(8, 3), "d": _prompt(9, 31)}
    driver = PagedDriver(_model(plain.path), block_size=4, seed=6)
    outputs = driver.generate(
        prompts, max_new_tokens=16, chunk_size=6, arrival_steps={"c": 2, "d": 4}
    )
    assert any(lens.count(1) >= 2 and max(lens) > 1 for lens in driver.step_query_lens)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == plain.greedy(prompt, 16), req_id


def test_greedy_with_shared_prefix(plain: Checkpoint) -> None:
    prompt_a = _prompt(10, 17)
    prompt_b = prompt_a[:12] + _prompt(11, 6)
    driver = PagedDriver(_model(plain.path), block_size=4, seed=7)
    driver.generate({"a": prompt_a}, max_new_tokens=1)
    driver.add_request("b", prompt_b, share_prefix_from="a", num_shared_blocks=3)
    outputs = driver.generate({"a": prompt_a, "b": prompt_b}, max_new_tokens=14)
    assert driver.step_query_lens[1] == [1, 6]
    assert outputs["b"] == plain.greedy(prompt_b, 14)
    assert outputs["a"] == plain.greedy(prompt_a, 14)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_as_llama_with_the_split_weights(plain: Checkpoint, dtype: str) -> None:
    """The Phi-3 model is the Llama model of the same (split) weights, bit for bit, prefill and batched decode:
    Phi-3 takes the fused decode path wherever Llama does (bfloat16 on an AVX-512 CPU), as its layers are Llama's."""
    from kvflow.models.attention import resolve_attention_backend

    phi3 = load_model(plain.path, dtype=dtype)
    assert isinstance(phi3, Phi3ForCausalLM)
    llama = LlamaForCausalLM(
        phi3.config,
        dtype=phi3.dtype,
        attention_backend=resolve_attention_backend("auto", torch.device("cpu")),
    )
    llama.load_weights(phi3._split_fused(iterate_safetensors_weights(plain.path), False))
    assert (phi3.fused_decode is None) == (llama.fused_decode is None)
    prompt = _prompt(12, 21)
    prompts = {"a": _prompt(13, 7), "b": _prompt(14, 12)}
    logits, outputs = [], []
    for model in (phi3, llama):
        driver = PagedDriver(model, block_size=4, seed=12)
        driver.add_request("p", prompt)
        logits.append(driver.prompt_logits("p", [21]))
        outputs.append(driver.generate(prompts, max_new_tokens=8))
    assert torch.equal(logits[0], logits[1])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_loads_each_ranks_part_of_the_fused_tensors(
    plain: Checkpoint, rank: int
) -> None:
    """Under TP the fused tensor is read whole and cut per part: each rank holds exactly what a Llama rank holds
    from the split checkpoint (its q, k and v heads, its gate and up rows)."""
    config = load_hf_config(plain.path)
    tp = TensorParallelGroup(rank, 2)
    phi3 = Phi3ForCausalLM(config, dtype=torch.float32, tp=tp)
    phi3.load_weights(iterate_safetensors_weights(plain.path, phi3.checkpoint_index), sliced=True)
    split = list(_model(plain.path)._split_fused(iterate_safetensors_weights(plain.path), False))
    llama = LlamaForCausalLM(config, dtype=torch.float32, tp=tp)
    llama.load_weights(split)
    for (name, mine), (_, theirs) in zip(
        phi3.state_dict().items(), llama.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    # 2 of 4 query heads, 1 of 2 KV heads
    assert phi3.model.layers[0].self_attn.qkv_proj.weight.shape == (32 + 16 + 16, 64)


# ---------------------------------------------------------------------------------------------- LongRoPE
def test_longrope_rule_and_cos_sin_match_transformers(longrope: Checkpoint) -> None:
    """The factor set flips exactly past `original_max_position_embeddings`, and each set's cos/sin (with the
    attention factor) equals transformers' for a sequence on that side of the threshold."""
    model = _model(longrope.path)
    rotary = model.rotary_emb
    assert isinstance(rotary, LongRopeRotaryEmbedding)
    assert rotary.long  # max_position_embeddings 128 > 32: an engine of the default length is long
    hf_rotary = longrope.reference.model.rotary_emb
    positions = torch.arange(40)
    for max_model_len, hf_seq_len in ((ORIGINAL_MAX, ORIGINAL_MAX), (ORIGINAL_MAX + 1, 40)):
        model.set_max_model_len(max_model_len)
        assert rotary.long == (max_model_len > ORIGINAL_MAX)
        cos, sin = rotary.cos_sin(positions, torch.float32)
        x = torch.zeros(1, dtype=torch.float32)
        hf_cos, hf_sin = hf_rotary(x, torch.arange(hf_seq_len)[None])
        torch.testing.assert_close(cos[:hf_seq_len, 0], hf_cos[0, :, :8], rtol=0, atol=0)
        torch.testing.assert_close(sin[:hf_seq_len, 0], hf_sin[0, :, :8], rtol=0, atol=0)


def test_longrope_short_side(longrope: Checkpoint) -> None:
    """`max_model_len` at the threshold: the short factors, token-exact for sequences up to 32 tokens."""
    model = _model(longrope.path, max_model_len=ORIGINAL_MAX)
    prompt = _prompt(20, 30)
    driver = PagedDriver(model, block_size=4, seed=20)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [9, 21])
    torch.testing.assert_close(logits, longrope.logits(prompt), atol=ATOL, rtol=RTOL)
    prompts = {"a": _prompt(21, 10), "b": _prompt(22, 4)}
    outputs = PagedDriver(model, block_size=4, seed=21).generate(
        prompts, max_new_tokens=20, chunk_size=6
    )
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == longrope.greedy(prompt, 20), req_id


def test_longrope_long_side(longrope: Checkpoint) -> None:
    """`max_model_len` past the threshold: the long factors, token-exact for prompts longer than 32 tokens
    (chunked, batched, one on another's prefix blocks)."""
    model = _model(longrope.path, max_model_len=128)
    prompt = _prompt(23, 45)
    driver = PagedDriver(model, block_size=4, seed=23)
    driver.add_request("a", prompt)
    logits = driver.prompt_logits("a", [13, 32])
    torch.testing.assert_close(logits, longrope.logits(prompt), atol=ATOL, rtol=RTOL)
    driver.add_request(
        "b", prompt[:36] + _prompt(24, 5), share_prefix_from="a", num_shared_blocks=9
    )
    logits_b = driver.prompt_logits("b", [5])
    reference_b = longrope.logits(prompt[:36] + _prompt(24, 5))[36:]
    torch.testing.assert_close(logits_b, reference_b, atol=ATOL, rtol=RTOL)
    prompts = {"c": _prompt(25, 40), "d": _prompt(26, 33)}
    outputs = PagedDriver(model, block_size=4, seed=25).generate(
        prompts, max_new_tokens=16, chunk_size=8, arrival_steps={"d": 3}
    )
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == longrope.greedy(prompt, 16), req_id


def test_longrope_fused_decode_matches_the_per_op_layers(longrope: Checkpoint) -> None:
    """bfloat16 (the fused decode path where the CPU has it): the attention-scaled LongRoPE cos/sin reach the fused
    layer as they reach the per-op one."""
    outputs = []
    for fused in (True, False):
        model = load_model(longrope.path, dtype="bfloat16")
        assert isinstance(model, Phi3ForCausalLM)
        model.set_max_model_len(128)
        if not fused:
            model.fused_decode = None
        driver = PagedDriver(model, block_size=4, seed=27)
        outputs.append(
            driver.generate({"a": _prompt(27, 40), "b": _prompt(28, 35)}, max_new_tokens=10)
        )
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    ("async_scheduling", "use_v2_model_runner"), [(True, True), (False, False)]
)
def test_llm_generates_token_exact(
    longrope: Checkpoint, async_scheduling: bool, use_v2_model_runner: bool
) -> None:
    """`LLM` on the LongRoPE checkpoint applies the rule with its `max_model_len`: short prompts on a 32-token
    engine, long prompts on a 128-token engine, each batch token-exact."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cases = {
        ORIGINAL_MAX: [_prompt(30, 5), _prompt(31, 17)],
        128: [_prompt(32, 40), _prompt(33, 34)],
    }
    for max_model_len, prompts in cases.items():
        llm = LLM(
            str(longrope.path),
            skip_tokenizer_init=True,
            disable_log_stats=True,
            max_model_len=max_model_len,
            block_size=4,
            max_num_batched_tokens=16,
            async_scheduling=async_scheduling,
            use_v2_model_runner=use_v2_model_runner,
        )
        try:
            outputs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False
            )
        finally:
            llm.shutdown()
        for prompt, output in zip(prompts, outputs, strict=True):
            assert list(output.outputs[0].token_ids) == longrope.greedy(prompt, 12)


def test_legacy_su_config_reads_the_top_level_original_length() -> None:
    """Hub Phi-3 configs: `rope_scaling` type "su" without the original length, which sits at the top level; hub
    Phi-4-mini configs: `partial_rotary_factor` at the top level too, with factor lists for the rotated dims."""
    raw = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    }
    config = parse_hf_config(raw)
    assert config.rope_scaling == {
        "rope_type": "su",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 4096,
    }
    model = Phi3ForCausalLM(config, dtype=torch.float32)
    assert isinstance(model.rotary_emb, LongRopeRotaryEmbedding) and model.rotary_emb.long
    phi4 = {
        **raw,
        "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6},
    }
    config = parse_hf_config(phi4)
    assert config.rope_scaling == {
        "rope_type": "longrope",
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0] * 6,
        "long_factor": [2.0] * 6,
        "original_max_position_embeddings": 4096,
    }
    rotary = Phi3ForCausalLM(config, dtype=torch.float32).rotary_emb
    assert isinstance(rotary, LongRopeRotaryEmbedding) and rotary.rotary_dim == 12
    plain = parse_hf_config({**raw, "partial_rotary_factor": 0.75, "rope_scaling": None})
    assert plain.rope_scaling == {"rope_type": "default", "partial_rotary_factor": 0.75}
    assert Phi3ForCausalLM(plain, dtype=torch.float32).rotary_emb.rotary_dim == 12
    with pytest.raises(ValueError, match="short_factor has 8 entries for 6 frequencies"):
        Phi3ForCausalLM(
            parse_hf_config({**raw, "partial_rotary_factor": 0.75}), dtype=torch.float32
        )


# ---------------------------------------------------------------------------------------------- Phi-4-mini
class TestPhi4MiniFamily(FamilySuite, TensorParallelSuite):
    """The checks every family's comparison with transformers makes (`family_suite`), on the Phi-4-mini-shaped
    checkpoint: partial rotary with LongRoPE (one factor set) and tied embeddings."""

    vocab_size = VOCAB

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, phi4_mini: Checkpoint) -> Checkpoint:
        return phi4_mini

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, phi4_mini: Checkpoint) -> Phi3ForCausalLM:
        return _model(phi4_mini.path)


def test_phi4_mini_config_and_rotary_tables(phi4_mini: Checkpoint) -> None:
    """The model reads partial rotary, tied embeddings and GQA, and its tables (the attention factor applied) are
    transformers' for the 12 rotated dims."""
    model = _model(phi4_mini.path)
    config = model.config
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (16, 6, 2)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rotary = model.rotary_emb
    assert isinstance(rotary, LongRopeRotaryEmbedding) and not rotary.long
    assert rotary.rotary_dim == PHI4_ROTARY_DIM and rotary.attention_factor == 1.19
    cos, sin = rotary.cos_sin(torch.arange(64), torch.float32)
    hf_cos, hf_sin = phi4_mini.reference.model.rotary_emb(
        torch.zeros(1, dtype=torch.float32), torch.arange(64)[None]
    )
    assert hf_cos.shape[-1] == PHI4_ROTARY_DIM
    half = PHI4_ROTARY_DIM // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :half], rtol=0, atol=0)


def test_phi4_mini_both_factor_sets(phi4_mini_long: Checkpoint) -> None:
    """Partial rotary with both LongRoPE factor sets (the default attention factor): each set's tables are
    transformers' on its side of the threshold, and each side is token-exact (a 30-token prompt on a 32-token
    engine, prompts past 32 tokens on a 128-token engine)."""
    model = _model(phi4_mini_long.path)
    rotary = model.rotary_emb
    assert isinstance(rotary, LongRopeRotaryEmbedding) and rotary.rotary_dim == PHI4_ROTARY_DIM
    hf_rotary = phi4_mini_long.reference.model.rotary_emb
    half = PHI4_ROTARY_DIM // 2
    for max_model_len, hf_seq_len in ((ORIGINAL_MAX, ORIGINAL_MAX), (128, 40)):
        model.set_max_model_len(max_model_len)
        cos, sin = rotary.cos_sin(torch.arange(hf_seq_len), torch.float32)
        hf_cos, hf_sin = hf_rotary(torch.zeros(1), torch.arange(hf_seq_len)[None])
        torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], rtol=0, atol=0)
        torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :half], rtol=0, atol=0)
    cases = {ORIGINAL_MAX: (_prompt(40, 30), {"a": _prompt(41, 10), "b": _prompt(42, 4)}, 20)}
    cases[128] = (_prompt(43, 45), {"c": _prompt(44, 40), "d": _prompt(45, 33)}, 16)
    for max_model_len, (prompt, prompts, max_new_tokens) in cases.items():
        model.set_max_model_len(max_model_len)
        driver = PagedDriver(model, block_size=4, seed=max_model_len)
        driver.add_request("p", prompt)
        logits = driver.prompt_logits("p", [9, len(prompt) - 9])
        torch.testing.assert_close(logits, phi4_mini_long.logits(prompt), atol=ATOL, rtol=RTOL)
        outputs = PagedDriver(model, block_size=4, seed=max_model_len + 1).generate(
            prompts, max_new_tokens=max_new_tokens, chunk_size=8
        )
        for req_id, request_prompt in prompts.items():
            assert outputs[req_id] == phi4_mini_long.greedy(request_prompt, max_new_tokens)


def test_phi4_mini_fused_decode_declines_partial_rotary(phi4_mini: Checkpoint) -> None:
    """The C++ decode layer rotates whole heads: the fused path declines a partial-rotary model (it would take the
    same model with whole-head RoPE where the CPU has AVX-512), and the model runs its per-op layers."""
    model = load_model(phi4_mini.path, dtype="bfloat16")
    assert isinstance(model, Phi3ForCausalLM)
    assert model.fused_decode is None

    def select(config: Any) -> FusedDecodeLayers | None:
        return FusedDecodeLayers.select(
            config,
            list(model.model.layers),
            model.layer_windows,
            model.attention_backend,
            dtype=model.dtype,
            device=model.device,
            tp=model.tp,
        )

    assert select(model.config) is None
    ops = load_cpu_kernels()
    if ops is not None and ops.has_avx512():
        assert select(dataclasses.replace(model.config, rope_scaling=None)) is not None
    outputs = PagedDriver(model, block_size=4, seed=50).generate(
        {"a": _prompt(50, 9), "b": _prompt(51, 14)}, max_new_tokens=6
    )
    assert [len(tokens) for tokens in outputs.values()] == [6, 6]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
