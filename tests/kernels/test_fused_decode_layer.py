"""`decode_layer`: a decode-only step of a bfloat16 model runs each decoder layer as one C++ call. It chains the
kernels the per-op path calls, in the same order, so every step's logits must equal the per-op path's bit for bit,
with QKV bias (Qwen2), without (Llama), with a sliding window (Mistral, sequences longer than the window) and with
Qwen3's per-head q/k norms.

The path is a strategy (`FusedDecodeLayers`) chosen once when the model is built; its row limit is the extension's
own `kMaxDecodeLayerRows`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvflow import kernels
from kvflow.kernels.build import SOURCE_DIR
from kvflow.models.fused_decode import FusedDecodeLayers, decode_layer_weights
from kvflow.models.hf_config import load_hf_config
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import load_model
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.models.paged_model_driver import PagedDriver

ARCHITECTURES = {
    "qwen2": {},
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen3": {},
}


@pytest.fixture(autouse=True)
def cpu_default_gemm_kernel(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """The CPU's static GEMM kernel for every row band (`KVFLOW_BF16_GEMM` set to it), not a measured plan: these
    tests check the fused path against the per-op one above the GEMV's rows, which a plan that measured torch
    faster just above them would route around. Without the AVX-512 kernels (or under `kernels_off`) nothing is
    forced."""
    kernels.forget_bf16_gemm_plan()
    ops = None if "kernels_off" in request.fixturenames else kernels.load_cpu_kernels()
    if (
        ops is not None
        and ops.has_avx512()
        and kernels.gemm_kernel_wins(kernels.cpu_feature_flags())
    ):
        monkeypatch.setenv(kernels.BF16_GEMM_ENV, str(ops.default_gemm_kernel()))
    yield
    monkeypatch.delenv(kernels.BF16_GEMM_ENV, raising=False)
    kernels.forget_bf16_gemm_plan()


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
    path: Path,
    fused: bool,
    prompt_lens: tuple[int, ...] = (5, 13, 3),
    strategy: Callable[[LlamaForCausalLM], FusedDecodeLayers] | None = None,
) -> tuple[dict[str, list[int]], list[torch.Tensor], int, list[int]]:
    """`_drive` a freshly loaded bfloat16 model: with `fused`, the strategy it chose at construction (there must
    be one) or `strategy(model)` in its place; otherwise without one (the per-op path only)."""
    model = load_model(path, dtype="bfloat16", attention_backend="cpu")
    assert isinstance(model, LlamaForCausalLM)
    if strategy is not None:
        model.fused_decode = strategy(model)
    elif fused:  # bfloat16, "cpu" backend, AVX-512: chosen at construction
        assert model.fused_decode is not None
    if not fused:
        model.fused_decode = None
    return _drive(model, prompt_lens)


def _drive(
    model: LlamaForCausalLM, prompt_lens: tuple[int, ...] = (5, 13, 3)
) -> tuple[dict[str, list[int]], list[torch.Tensor], int, list[int]]:
    """Greedy outputs, every forward's logits, how many forwards took the fused path and their row counts."""
    logits: list[torch.Tensor] = []
    num_fused = 0
    fused_rows: list[int] = []
    original_forward = model.forward

    def recording_forward(batch, kv_cache):  # type: ignore[no-untyped-def]
        out = original_forward(batch, kv_cache)
        logits.append(out.clone())
        return out

    model.forward = recording_forward  # type: ignore[method-assign]
    fused_decode = model.fused_decode
    if fused_decode is not None:
        original_run = fused_decode.run

        def counting_run(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal num_fused
            out = original_run(batch, *args, **kwargs)
            if out is not None:
                num_fused += 1
                fused_rows.append(batch.num_tokens)
            return out

        fused_decode.run = counting_run  # type: ignore[method-assign]
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
        pytest.skip(
            "the fused decode_layer runs on AVX-512 machines only (its AVX2 build is not measured)"
        )
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
            "kvflow's GEMM serves > 8 rows only on AVX-512 CPUs (KVFLOW_BF16_GEMM not torch)"
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


@pytest.mark.parametrize("gemm_kernel", ["amx_bf16_emulated", "avx512_bf16"])
def test_each_gemm_kernel_serves_the_fused_and_per_op_paths_alike(
    ops: ModuleType, checkpoint: Path, gemm_kernel: str
) -> None:
    """The GEMM plan is one process-wide choice that the per-op products (`kernels.linear`) and the fused
    decode layer's (`decode_layer` -> `gemm`, on the plan's first band's kernel) both follow: with another kernel
    chosen the two paths still agree bit for bit, and the logits stay near the default kernel's (another summation
    order, bfloat16 rounding: a loose bound, which a transposed or misplaced tile output would break by far)."""
    if not kernels.gemm_kernel_wins_here() or not ops.has_avx512():
        pytest.skip(
            "kvflow's GEMM serves > 8 rows only on AVX-512 CPUs (KVFLOW_BF16_GEMM not torch)"
        )
    if gemm_kernel == "avx512_bf16" and not kernels.cpu_executes_avx512_bf16():
        pytest.skip("this CPU does not execute vdpbf16ps")
    prompt_lens = (5, 13, 3, 7, 9, 4, 6, 11, 8, 5, 10, 3)
    _, default_logits, _, _ = _run(checkpoint, fused=False, prompt_lens=prompt_lens)
    kernels.use_bf16_gemm_plan(kernels.Bf16GemmPlan.uniform(gemm_kernel))
    try:
        fused_outputs, fused_logits, num_fused, fused_rows = _run(
            checkpoint, fused=True, prompt_lens=prompt_lens
        )
        per_op_outputs, per_op_logits, _, _ = _run(checkpoint, fused=False, prompt_lens=prompt_lens)
    finally:
        kernels.forget_bf16_gemm_plan()
        kernels.bf16_gemm_kernel()  # the static kernel again, for the fused path too
    assert num_fused >= 10 and max(fused_rows) > kernels.MAX_GEMV_ROWS
    assert fused_outputs == per_op_outputs
    for step, (fused, per_op) in enumerate(zip(fused_logits, per_op_logits, strict=True)):
        assert torch.equal(fused, per_op), f"step {step}"
    torch.testing.assert_close(per_op_logits[0], default_logits[0], atol=0.25, rtol=0.05)


def _forced_strategy(
    ops: ModuleType, max_rows: int
) -> Callable[[LlamaForCausalLM], FusedDecodeLayers]:
    """The fused path built directly (any build of the kernels has `decode_layer`), whatever the CPU."""

    def build(model: LlamaForCausalLM) -> FusedDecodeLayers:
        return FusedDecodeLayers(
            ops,
            list(model.model.layers),
            [model.config.layer_sliding_window(i) for i in range(model.num_layers)],
            num_heads=model.attention_backend.num_heads,
            eps=model.config.rms_norm_eps,
            scale=model.attention_backend.scale,
            max_rows=max_rows,
        )

    return build


def test_the_fused_path_takes_only_decode_only_steps_within_its_row_limit(
    ops: ModuleType, checkpoint: Path
) -> None:
    """On any CPU with the kernels: the strategy reads the paging of decode-only steps (one window or several)
    from the "cpu" backend's metadata, takes no step with more rows than its limit, and computes what the per-op
    path computes (bit for bit on AVX-512 builds, where both run the same kernels; to rounding elsewhere)."""
    prompt_lens = (5, 13, 3)
    fused_outputs, fused_logits, num_fused, fused_rows = _run(
        checkpoint, fused=True, prompt_lens=prompt_lens, strategy=_forced_strategy(ops, 2)
    )
    per_op_outputs, per_op_logits, _, _ = _run(checkpoint, fused=False, prompt_lens=prompt_lens)
    assert num_fused >= 2 and set(fused_rows) <= {1, 2}  # 3 decoding requests: never fused
    assert fused_outputs == per_op_outputs
    for step, (fused, per_op) in enumerate(zip(fused_logits, per_op_logits, strict=True)):
        torch.testing.assert_close(fused, per_op, rtol=1e-2, atol=1e-2, msg=f"step {step}")


def test_the_row_limit_is_the_extensions(ops: ModuleType) -> None:
    """kernels.h's kMaxDecodeLayerRows is the one source: the module exports it and `decode_layer` enforces it."""
    header = (SOURCE_DIR / "kernels.h").read_text()
    match = re.search(r"kMaxDecodeLayerRows = (\d+);", header)
    assert match is not None
    assert kernels.decode_layer_max_rows() == ops.MAX_DECODE_LAYER_ROWS == int(match.group(1))
    limit = kernels.decode_layer_max_rows()
    _call_decode_layer(ops, _LAYER_WEIGHTS, slot=0, num_rows=limit)
    with pytest.raises(RuntimeError, match=rf"rows must be in \[1, {limit}\]"):
        _call_decode_layer(ops, _LAYER_WEIGHTS, slot=0, num_rows=limit + 1)


def test_without_the_kernels_there_is_no_row_limit_and_no_fused_path(
    kernels_off: None, checkpoint: Path
) -> None:
    assert kernels.decode_layer_max_rows() == 0
    model = LlamaForCausalLM(
        load_hf_config(checkpoint), dtype=torch.bfloat16, attention_backend="cpu"
    )
    assert model.fused_decode is None


def test_the_strategy_is_chosen_once_when_the_model_is_built(
    ops: ModuleType, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_hf_config(checkpoint)
    assert (
        LlamaForCausalLM(config, dtype=torch.bfloat16, attention_backend="torch").fused_decode
        is None
    )
    assert (
        LlamaForCausalLM(config, dtype=torch.float32, attention_backend="cpu").fused_decode is None
    )
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, attention_backend="cpu")
    if not ops.has_avx512():
        assert model.fused_decode is None
        return
    assert model.fused_decode is not None
    assert model.fused_decode.max_rows == min(
        kernels.decode_layer_max_rows(), kernels.bf16_kernel_max_rows() or 1 << 30
    )

    def no_second_choice(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused path is chosen again")

    model = load_model(checkpoint, dtype="bfloat16", attention_backend="cpu")
    monkeypatch.setattr(FusedDecodeLayers, "select", no_second_choice)
    outputs, _, num_fused, _ = _drive(model)
    assert num_fused > 0 and outputs


def test_a_qwen3_model_selects_the_fused_path_with_its_head_norms(
    ops: ModuleType, tmp_path: Path
) -> None:
    if not ops.has_avx512():  # type: ignore[attr-defined]
        pytest.skip("the bfloat16 fused decode_layer runs on AVX-512 machines only")
    path = make_tiny_checkpoint(tmp_path, "qwen3", dtype="bfloat16", num_hidden_layers=2)
    model = LlamaForCausalLM(load_hf_config(path), dtype=torch.bfloat16, attention_backend="cpu")
    assert model.config.qk_norm
    assert isinstance(model.fused_decode, FusedDecodeLayers)
    attention = model.model.layers[1].self_attn
    weights = decode_layer_weights(model.model.layers[1])
    assert weights[2] is attention.q_norm.weight and weights[3] is attention.k_norm.weight


def test_decode_layer_takes_both_head_norms_or_neither(ops: ModuleType) -> None:
    head_norm = torch.ones(_HEAD_DIM, dtype=torch.bfloat16)
    both = (*_LAYER_WEIGHTS[:2], head_norm, head_norm, *_LAYER_WEIGHTS[4:])
    _call_decode_layer(ops, both, slot=0)
    with pytest.raises(RuntimeError, match="q_norm and k_norm come together"):
        _call_decode_layer(ops, (*_LAYER_WEIGHTS[:2], head_norm, *_LAYER_WEIGHTS[3:]), slot=0)
    with pytest.raises(RuntimeError, match="k_norm must be contiguous"):
        _call_decode_layer(
            ops, (*_LAYER_WEIGHTS[:2], head_norm, head_norm[:-1], *_LAYER_WEIGHTS[4:]), slot=0
        )


_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _INTERMEDIATE = 32, 4, 2, 8, 48
_LAYER_WEIGHTS = (
    torch.ones(_HIDDEN, dtype=torch.bfloat16),
    torch.ones(_HIDDEN, dtype=torch.bfloat16),
    None,  # no per-head q/k norms
    None,
    torch.zeros((_HEADS + 2 * _KV_HEADS) * _HEAD_DIM, _HIDDEN, dtype=torch.bfloat16),
    None,
    torch.zeros(_HIDDEN, _HEADS * _HEAD_DIM, dtype=torch.bfloat16),
    None,
    torch.zeros(2 * _INTERMEDIATE, _HIDDEN, dtype=torch.bfloat16),
    None,
    torch.zeros(_HIDDEN, _INTERMEDIATE, dtype=torch.bfloat16),
    None,
)


def _call_decode_layer(
    ops: ModuleType,
    layer_weights: tuple[torch.Tensor | None, ...],
    slot: int,
    num_rows: int = 1,
    kv_cache: torch.Tensor | None = None,
) -> None:
    """One `decode_layer` call on a tiny layer: `num_rows` rows, each in its own one-block sequence, the first
    writing KV slot `slot` (the others slots 0..)."""
    bf16 = torch.bfloat16
    if kv_cache is None:
        kv_cache = torch.zeros(1, 2, _KV_HEADS, 4, 4, _HEAD_DIM, dtype=bf16)
    slots = [slot] + [row % 16 for row in range(1, num_rows)]
    ops.decode_layer(
        torch.ones(num_rows, _HIDDEN, dtype=bf16),
        None,
        *layer_weights,
        torch.ones(num_rows, 1, _HEAD_DIM // 2, dtype=bf16),
        torch.zeros(num_rows, 1, _HEAD_DIM // 2, dtype=bf16),
        kv_cache,
        0,
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor([[row % 4] for row in range(num_rows)], dtype=torch.int32),
        torch.ones(num_rows, dtype=torch.int32),
        _HEADS,
        1e-6,
        _HEAD_DIM**-0.5,
        0,
        8,
    )


def test_decode_layer_rejects_a_slot_outside_the_cache(ops: ModuleType) -> None:
    kv_cache = torch.zeros(1, 2, _KV_HEADS, 4, 4, _HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot_mapping has a slot outside"):
        _call_decode_layer(ops, _LAYER_WEIGHTS, slot=16, kv_cache=kv_cache)
    assert not kv_cache.any()
    with pytest.raises(RuntimeError, match="qkv must be contiguous"):
        bad = (*_LAYER_WEIGHTS[:4], _LAYER_WEIGHTS[4][:-1], *_LAYER_WEIGHTS[5:])  # type: ignore[index]
        _call_decode_layer(ops, bad, slot=0)
