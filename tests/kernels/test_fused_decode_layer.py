"""`decode_layer`: a decode-only step of a bfloat16 model runs each decoder layer as one C++ call. It chains the
kernels the per-op path calls, in the same order, so every step's logits must equal the per-op path's bit for bit,
with QKV bias (Qwen2), without (Llama) and with a sliding window (Mistral, sequences longer than the window)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow import kernels
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import load_model
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.models.paged_model_driver import PagedDriver

ARCHITECTURES = {
    "qwen2": {},
    "llama": {},
    "mistral": {"sliding_window": 8},
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    architecture = request.param
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp(architecture),
        architecture,
        seed=5,
        dtype="bfloat16",
        **ARCHITECTURES[architecture],
    )


def _run(
    path: Path, fused: bool, prompt_lens: tuple[int, ...] = (5, 13, 3)
) -> tuple[dict[str, list[int]], list[torch.Tensor], int, list[int]]:
    """Greedy outputs, every forward's logits, how many forwards took the fused path and their row counts."""
    model = load_model(path, dtype="bfloat16")
    assert isinstance(model, LlamaForCausalLM)
    if not fused:
        model._fused_decode = False
    logits: list[torch.Tensor] = []
    num_fused = 0
    fused_rows: list[int] = []
    original_forward = model.forward
    original_fused_layers = model._fused_decode_layers

    def recording_forward(batch, kv_cache):  # type: ignore[no-untyped-def]
        out = original_forward(batch, kv_cache)
        logits.append(out.clone())
        return out

    def counting_fused_layers(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal num_fused
        num_fused += 1
        fused_rows.append(args[0].shape[0])
        return original_fused_layers(*args, **kwargs)

    model.forward = recording_forward  # type: ignore[method-assign]
    model._fused_decode_layers = counting_fused_layers  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(7)
    prompts = {
        f"r{index}": torch.randint(3, 384, (length,), generator=generator).tolist()
        for index, length in enumerate(prompt_lens)
    }
    driver = PagedDriver(model, block_size=4, seed=3)
    outputs = driver.generate(prompts, max_new_tokens=14, chunk_size=6, arrival_steps={"r2": 4})
    return outputs, logits, num_fused, fused_rows


def test_fused_decode_layers_equal_the_per_op_path_bit_for_bit(
    ops: object, checkpoint: Path
) -> None:
    if not ops.has_avx512():  # type: ignore[attr-defined]
        pytest.skip("decode_layer runs where the GEMV kernel does: AVX-512 machines")
    fused_outputs, fused_logits, num_fused, _ = _run(checkpoint, fused=True)
    per_op_outputs, per_op_logits, num_per_op_fused, _ = _run(checkpoint, fused=False)
    assert num_per_op_fused == 0
    # Prefill and mixed steps take the per-op path; the decode-only steps (most of them) the fused one.
    assert 0 < num_fused < len(fused_logits)
    assert num_fused >= 10
    assert fused_outputs == per_op_outputs
    assert len(fused_logits) == len(per_op_logits)
    for step, (fused, per_op) in enumerate(zip(fused_logits, per_op_logits, strict=True)):
        assert torch.equal(fused, per_op), f"step {step}"


def test_fused_decode_steps_above_the_gemv_rows_take_the_gemm_like_the_per_op_path(
    ops: object, checkpoint: Path
) -> None:
    """12 decoding requests: more rows than MAX_GEMV_ROWS, so both paths' products run on the GEMM kernel."""
    if not kernels.gemm_kernel_wins_here() or not ops.has_avx512():  # type: ignore[attr-defined]
        pytest.skip(
            "the GEMM kernel serves > 8 rows only on AVX-512 CPUs without native bf16 matmul"
        )
    prompt_lens = (5, 13, 3, 7, 9, 4, 6, 11, 8, 5, 10, 3)
    fused_outputs, fused_logits, num_fused, fused_rows = _run(
        checkpoint, fused=True, prompt_lens=prompt_lens
    )
    per_op_outputs, per_op_logits, _, _ = _run(checkpoint, fused=False, prompt_lens=prompt_lens)
    assert num_fused >= 10
    assert max(fused_rows) > kernels.MAX_GEMV_ROWS
    assert fused_outputs == per_op_outputs
    for step, (fused, per_op) in enumerate(zip(fused_logits, per_op_logits, strict=True)):
        assert torch.equal(fused, per_op), f"step {step}"


def test_decode_layer_rejects_a_slot_outside_the_cache(ops: object) -> None:
    hidden_size, heads, kv_heads, head_dim, intermediate = 32, 4, 2, 8, 48
    bf16 = torch.bfloat16
    weights = (
        torch.ones(hidden_size, dtype=bf16),
        torch.ones(hidden_size, dtype=bf16),
        torch.zeros((heads + 2 * kv_heads) * head_dim, hidden_size, dtype=bf16),
        None,
        torch.zeros(hidden_size, heads * head_dim, dtype=bf16),
        None,
        torch.zeros(2 * intermediate, hidden_size, dtype=bf16),
        None,
        torch.zeros(hidden_size, intermediate, dtype=bf16),
        None,
    )
    kv_cache = torch.zeros(1, 2, kv_heads, 4, 4, head_dim, dtype=bf16)

    def call(layer_weights: tuple[torch.Tensor | None, ...], slot: int) -> None:
        ops.decode_layer(  # type: ignore[attr-defined]
            torch.ones(1, hidden_size, dtype=bf16),
            None,
            *layer_weights,
            torch.ones(1, 1, head_dim // 2, dtype=bf16),
            torch.zeros(1, 1, head_dim // 2, dtype=bf16),
            kv_cache,
            0,
            torch.tensor([slot], dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            heads,
            1e-6,
            head_dim**-0.5,
            0,
            8,
        )

    with pytest.raises(RuntimeError, match="slot_mapping has a slot outside"):
        call(weights, slot=16)
    assert not kv_cache.any()
    with pytest.raises(RuntimeError, match="qkv must be contiguous"):
        call((*weights[:2], weights[2][:-1], *weights[3:]), slot=0)
