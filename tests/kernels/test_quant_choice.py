"""Quantized products chosen by measurement (`kvflow.kernels.quant_plan`, `kvflow.kernels.quant_choice`): a plan is
measured per weight type, cached per machine and kernel build and read back by later processes, overridden by
`KVFLOW_QUANT_GEMM=static`, a deliberately slowed product is never chosen while a faster one exists, and the per-op
products and the fused decode layer's row limit follow the plan (the same extension call for every row count the
fused layer takes)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvflow.kernels import quant, quant_choice
from kvflow.kernels.choice import KernelChoice, KernelChoices, time_candidates
from kvflow.kernels.quant_plan import (
    DEQUANT,
    GEMV,
    QUANT_GEMM_BANDS,
    QUANT_GEMM_ENV,
    TILED,
    W8A8,
    KernelRows,
    QuantGemmPlan,
    forget_quant_gemm_plans,
    quant_gemm_plan,
    static_quant_plan,
    use_quant_gemm_plan,
    w8a8_built,
)
from kvflow.models.layers.linear import Linear
from kvflow.models.loader import load_model
from kvflow.models.quantization.gguf_writer import write_gguf
from kvflow.models.quantization.int8 import Int8Linear
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.kernels.test_fused_decode_layer import _drive

# [out, in] shapes small enough to time every band in a few ms (K a multiple of 256: every type applies).
SHAPES = [(384, 256), (256, 512)]


@pytest.fixture(autouse=True)
def measured_plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`KVFLOW_QUANT_GEMM` unset (auto) and no plan left from another test, before and after; one thread, so that
    the timings stay a few ms on a 2-core machine shared with other tests (two threads beside another busy process
    wait on each other for many times the product's time)."""
    monkeypatch.delenv(QUANT_GEMM_ENV, raising=False)
    forget_quant_gemm_plans()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    forget_quant_gemm_plans()


def _plan(weight_type: str, *products: str) -> QuantGemmPlan:
    """A plan with `products` for the bands in order (the last one repeated to the end)."""
    padded = [*products, *[products[-1]] * (len(QUANT_GEMM_BANDS) - len(products))]
    bands = tuple(
        (first, last, p) for (first, last), p in zip(QUANT_GEMM_BANDS, padded, strict=True)
    )
    return QuantGemmPlan(
        weight_type, bands, static_quant_plan(weight_type, w8a8_built()).above_gemv
    )


def test_static_plans_hold_the_thresholds() -> None:
    q8_0 = static_quant_plan("Q8_0", True)
    assert [q8_0.product_for(m) for m in (1, 8, 9, 32, 33, 5000)] == [
        GEMV, GEMV, TILED, TILED, W8A8, W8A8,
    ]  # fmt: skip
    assert static_quant_plan("Q8_0", False).product_for(33) == DEQUANT
    assert static_quant_plan("int8", True).product_for(9) == W8A8
    no_vnni = static_quant_plan("int8", False)
    assert [no_vnni.product_for(m) for m in (8, 9, 128, 129)] == [GEMV, TILED, TILED, DEQUANT]
    assert no_vnni.kernel_rows() == KernelRows(8, 128)
    assert static_quant_plan("int8", True).kernel_rows() == KernelRows(8, None)
    assert static_quant_plan("Q4_K", True).kernel_rows() == KernelRows(None, None)
    with pytest.raises(ValueError, match="unknown quantized weight type"):
        static_quant_plan("Q5_0", True)


def test_kernel_rows_cover_the_first_stretch_one_extension_call_runs() -> None:
    """The GEMV's bands from the first, then the extension's product above them; the stretch ends at the first
    band on another product."""
    assert _plan("Q8_0", GEMV, TILED, TILED, DEQUANT).kernel_rows() == KernelRows(16, 64)
    assert _plan("Q8_0", GEMV, GEMV, DEQUANT, TILED).kernel_rows() == KernelRows(32, 32)
    assert _plan("Q8_0", DEQUANT, TILED).kernel_rows() == KernelRows(8, 8)
    assert _plan("Q8_0", TILED).kernel_rows() == KernelRows(8, None)
    assert _plan("Q4_0", GEMV, GEMV, GEMV, GEMV, DEQUANT).kernel_rows() == KernelRows(128, 128)


def test_candidates_per_type_and_band(ops: ModuleType) -> None:
    above = W8A8 if ops.has_w8a8_kernels() else TILED
    assert quant_choice.candidate_products("int8", 16) == (GEMV, above)
    assert quant_choice.candidate_products("int8", None) == (above, DEQUANT)
    # No W8A8 up to 32 rows: x stays quantized per 32 (or float32 under KVFLOW_Q8_0_ACTIVATIONS=float32).
    assert quant_choice.candidate_products("Q8_0", 32) == (GEMV, TILED)
    assert W8A8 in quant_choice.candidate_products("Q8_0", 64) or not ops.has_w8a8_kernels()
    assert quant_choice.candidate_products("Q4_K", 16) == (GEMV, TILED)
    assert quant_choice.candidate_products("Q4_K", None) == (GEMV, TILED, DEQUANT)


def test_a_clear_loser_stops_after_two_rounds() -> None:
    """`drop_ratio`: a candidate more than that many times the fastest over the first two rounds runs no more
    rounds, and keeps its best time (products of ~0.1 ms against 40 of them: a preemption or two on a busy machine
    does not turn the order)."""
    a = torch.randn(192, 192)
    calls = {"fast": 0, "slow": 0}

    def fast() -> None:
        calls["fast"] += 1
        a @ a

    def slow() -> None:
        calls["slow"] += 1
        for _ in range(40):
            a @ a

    times = time_candidates({"fast": fast, "slow": slow}, rounds=5, drop_ratio=4.0)
    assert calls == {"fast": 6, "slow": 3}
    assert times["slow"] > 4.0 * times["fast"]


def test_a_band_keeps_the_static_product_unless_another_is_clearly_faster() -> None:
    def choice(**times_ms: float) -> KernelChoice:
        return KernelChoice("key", min(times_ms, key=times_ms.__getitem__), times_ms)

    assert quant_choice.band_product(choice(gemv=9.75, tiled=9.90), TILED) == TILED  # a tie
    assert quant_choice.band_product(choice(gemv=9.0, tiled=9.90), TILED) == GEMV
    assert quant_choice.band_product(choice(gemv=9.0, tiled=9.90), W8A8) == GEMV  # not measured
    assert quant_choice.band_product(choice(tiled=9.0, gemv=9.9), TILED) == TILED


def _slowed(weight_type: str, product: str) -> quant_choice.Product:
    """A real product run three times over: slower than itself on any machine, however busy."""

    def run(x: torch.Tensor, weight: quant_choice.TimedWeight) -> None:
        for _ in range(3):
            quant.run_product(weight_type, product, x, weight.data, weight.scale)

    return run


def test_a_plan_is_measured_never_picks_a_slowed_product_and_later_processes_read_it(
    ops: ModuleType, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each real product competes beside a copy of itself slowed 3x: every band takes a real one, the plan is
    logged once per type and becomes the process's, and a later process (a new `KernelChoices` on the same file)
    reads it without timing anything."""
    path = tmp_path / "choices.json"
    types = ("int8", "Q4_0")
    extra: dict[str, dict[str, quant_choice.Product]] = {
        weight_type: {
            f"slowed_{product}": _slowed(weight_type, product)
            for product in quant_choice.candidate_products(weight_type, 16)
        }
        for weight_type in types
    }
    with caplog.at_level(logging.INFO, logger="kvflow.kernels.quant_choice"):
        plans = quant_choice.choose_quant_gemm_plans(
            dict.fromkeys(types, SHAPES), choices=KernelChoices(path), extra_candidates=extra
        )
    for weight_type in types:
        plan = plans[weight_type]
        assert quant_gemm_plan(weight_type) == plan
        assert [(first, last) for first, last, _ in plan.bands] == list(QUANT_GEMM_BANDS)
        for (_, last, product), choice in zip(plan.bands, plan.choices, strict=True):
            assert not product.startswith("slowed_"), plan.describe()
            assert product in quant_choice.candidate_products(weight_type, last)
            assert choice.source == "measured"
            assert set(choice.times_ms) == {
                *quant_choice.candidate_products(weight_type, last),
                *extra[weight_type],
            }
    logged = [r.getMessage() for r in caplog.records if "chosen by measurement" in r.getMessage()]
    assert len(logged) == 2 and "rows 9-16" in logged[0] and "384x256" in logged[0]

    forget_quant_gemm_plans()

    def must_not_run(x: torch.Tensor, weight: quant_choice.TimedWeight) -> None:
        raise AssertionError("a cached choice is measured again")

    again = quant_choice.choose_quant_gemm_plans(
        dict.fromkeys(types, SHAPES),
        choices=KernelChoices(path),
        extra_candidates={t: dict.fromkeys(extra[t], must_not_run) for t in types},
    )
    for weight_type in types:
        assert again[weight_type].bands == plans[weight_type].bands
        assert all(choice.source == "cached" for choice in again[weight_type].choices)


def test_kvflow_quant_gemm_static_overrides_the_measurement(
    ops: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(QUANT_GEMM_ENV, "static")
    path = tmp_path / "choices.json"
    plans = quant_choice.choose_quant_gemm_plans({"Q8_0": SHAPES}, choices=KernelChoices(path))
    assert plans["Q8_0"] == static_quant_plan("Q8_0", w8a8_built()) and not plans["Q8_0"].choices
    assert not path.exists()  # nothing measured
    monkeypatch.setenv(QUANT_GEMM_ENV, "fastest")
    with pytest.raises(ValueError, match="KVFLOW_QUANT_GEMM='fastest' is not one of auto, static"):
        quant_choice.choose_quant_gemm_plans({"Q8_0": SHAPES}, choices=KernelChoices(path))


def _blocks(qtype: str, rows: int, columns: int) -> torch.Tensor:
    return quant_choice.synthetic_weight(
        qtype, rows, columns, torch.Generator().manual_seed(3)
    ).data


def test_products_follow_the_plan_band_by_band_and_agree_with_the_fused_call(
    ops: ModuleType,
) -> None:
    """Q8_0 on the GEMV up to 16 rows, the tiled kernel up to 32, the dequantized GEMM above: `ggml_linear` runs
    each band's product (bit for bit `run_product`), and for every row count up to the plan's `max_rows` it equals
    the one extension call the fused decode layer makes with the plan's `gemv_max_rows`."""
    use_quant_gemm_plan(_plan("Q8_0", GEMV, TILED, DEQUANT))
    rows = quant.kernel_rows("Q8_0")
    assert rows == KernelRows(16, 32)
    blocks = _blocks("Q8_0", 96, 256)
    generator = torch.Generator().manual_seed(5)
    for num_rows, product in (
        (3, GEMV),
        (12, GEMV),
        (16, GEMV),
        (17, TILED),
        (32, TILED),
        (40, DEQUANT),
    ):
        x = torch.randn(num_rows, 256, generator=generator)
        out = quant.ggml_linear(x, "Q8_0", blocks)
        assert torch.equal(out, quant.run_product("Q8_0", product, x, blocks)), num_rows
        if num_rows <= rows.max_rows:
            fused = ops.ggml_linear(
                x, blocks, quant.ggml_type_code("Q8_0"), None, rows.gemv_max_rows
            )
            assert torch.equal(out, fused), num_rows
    assert not quant.quantizes_activation_rows("Q8_0", 40)
    if ops.has_w8a8_kernels():
        use_quant_gemm_plan(_plan("Q8_0", GEMV, TILED, W8A8))
        assert quant.quantizes_activation_rows("Q8_0", 40)
        assert not quant.quantizes_activation_rows("Q8_0", 32)


def test_an_int8_layers_fused_product_follows_the_plan(ops: ModuleType) -> None:
    use_quant_gemm_plan(_plan("int8", GEMV, GEMV, DEQUANT))
    layer = Linear(256, [64], bias=False, dtype=torch.float32, device="cpu")
    product = Int8Linear(layer).fused_decode_product()
    assert product is not None
    assert product.max_rows == 32 and product.runs[0].gemv_max_rows == 32
    qweight, scale = quant.int8_quantize(torch.randn(64, 256))
    x = torch.randn(20, 256)
    assert torch.equal(
        quant.int8_linear(x, qweight, scale), ops.int8_linear(x, qweight, scale, None, 32)
    )
    assert not quant.quantizes_activation_rows("int8", 20)


@pytest.fixture(scope="module")
def q8_0_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quant_choice")
    checkpoint = make_tiny_checkpoint(
        root / "qwen2", "qwen2", seed=11, hidden_size=256, intermediate_size=512, head_dim=64
    )
    return write_gguf(checkpoint, root / "q8.gguf", "Q8_0")


def test_a_model_measures_its_types_and_its_fused_layer_follows(
    ops: ModuleType, q8_0_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q8_0 GGUF model built under auto measures the Q8_0 plan on its layer shapes (into the cache file beside
    the kernels: here a temporary one) and its fused decode layer stops where that plan's extension call does."""
    monkeypatch.setattr(quant_choice, "default_choices_path", lambda: tmp_path / "choices.json")
    model = load_model(q8_0_file, attention_backend="cpu")
    plan = quant_gemm_plan("Q8_0")
    assert plan.choices and all(choice.source == "measured" for choice in plan.choices)
    assert (tmp_path / "choices.json").exists()
    limit = int(ops.MAX_DECODE_LAYER_ROWS)
    max_rows = plan.kernel_rows().max_rows
    assert model.fused_decode is not None
    assert model.fused_decode.max_rows == (limit if max_rows is None else min(limit, max_rows))


def test_fused_and_per_op_paths_agree_under_a_plan_other_than_the_static_one(
    ops: ModuleType, q8_0_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q8_0 on its GEMV up to 16 rows and on the tiled kernel up to 32 (`gemv_max_rows` 16, `max_rows` 32, where
    the static plan has 8 and 32): 20 requests decode on the fused layer (steps above 16 rows among them) and on
    the per-op products alike, bit for bit."""
    monkeypatch.setenv(
        QUANT_GEMM_ENV, "static"
    )  # measure nothing: the plan below stays the process's
    use_quant_gemm_plan(_plan("Q8_0", GEMV, TILED, DEQUANT))
    prompt_lens = tuple(3 + index % 7 for index in range(20))
    fused_model = load_model(q8_0_file, attention_backend="cpu")
    assert fused_model.fused_decode is not None and fused_model.fused_decode.max_rows == 32
    fused_outputs, fused_logits, num_fused, fused_rows = _drive(fused_model, prompt_lens)
    per_op_model = load_model(q8_0_file, attention_backend="cpu")
    per_op_model.fused_decode = None
    per_op_outputs, per_op_logits, _, _ = _drive(per_op_model, prompt_lens)
    assert num_fused >= 10 and max(fused_rows) > 16
    assert fused_outputs == per_op_outputs
    for step, (fused, per_op) in enumerate(zip(fused_logits, per_op_logits, strict=True)):
        assert torch.equal(fused, per_op), f"step {step}"


def test_q8_0_choices_are_kept_per_activation_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0's products run on quantized or float32 x by KVFLOW_Q8_0_ACTIVATIONS, so its measured choices are cached
    under the setting (another setting measures afresh); the other types' keys do not name it."""
    keys = {}
    for value in ("int8", "float32"):
        monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", value)
        keys[value] = {
            weight_type: quant_choice._choice_key(weight_type, 9, 16, 16, torch.float32, SHAPES)
            for weight_type in ("Q8_0", "Q4_0")
        }
    assert (
        keys["int8"]["Q8_0"] != keys["float32"]["Q8_0"]
        and "activations int8" in keys["int8"]["Q8_0"]
    )
    assert keys["int8"]["Q4_0"] == keys["float32"]["Q4_0"]
