"""benchmarks/throughput.py in quick mode: it runs every system on a tiny checkpoint and prints its table.

Structural checks only (never timing assertions: CI machines are noisy). Imported as `benchmarks.<name>`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest


def load_benchmark():  # type: ignore[no-untyped-def]
    return importlib.import_module("benchmarks.throughput")


def test_workload_is_fixed_by_its_seed() -> None:
    benchmark = load_benchmark()
    first = benchmark.make_workload(64, (32, 256), (32, 128), 32000, seed=0)
    again = benchmark.make_workload(64, (32, 256), (32, 128), 32000, seed=0)
    assert first == again
    assert all(32 <= len(prompt) <= 256 for prompt in first.prompts)
    assert all(32 <= n <= 128 for n in first.output_lens) and len(first.output_lens) == 64


def test_quick_run_prints_every_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    benchmark = load_benchmark()
    benchmark.main(["--quick", "--checkpoint-dir", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    for system in ("HF static", "kvflow ", "kvflow forward only", "kvflow sync"):
        assert system in out
    assert "kvflow / HF static throughput:" in out and "async / sync scheduling throughput:" in out
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    assert "compute floor" in out and "physical floor" in out
    goal_rows = {
        line.split()[2]: line.split() for line in out.splitlines() if line.startswith("kvflow / ")
    }
    assert set(goal_rows) >= {"compute", "physical", "HF"}
    for goal in ("compute", "physical", "HF"):
        assert goal_rows[goal][-1] in ("PASS", "MISS")
    assert goal_rows["physical"][-2] == "0.6"  # the target against the physical floor


def load_compute_floor():  # type: ignore[no-untyped-def]
    return importlib.import_module("benchmarks.compute_floor")


def test_row_grid_covers_one_to_the_largest_row_count() -> None:
    compute_floor = load_compute_floor()
    assert compute_floor.row_grid(1) == [1]
    assert compute_floor.row_grid(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    assert compute_floor.row_grid(64)[-1] == 64


def test_interpolation_is_exact_on_the_grid_and_linear_between() -> None:
    compute_floor = load_compute_floor()
    measured = {1: 1.0, 4: 4.0, 8: 6.0}
    assert compute_floor.interpolate(measured, 4) == 4.0
    assert compute_floor.interpolate(measured, 6) == 5.0
    assert compute_floor.interpolate(measured, 0) == 0.0
    assert compute_floor.interpolate(measured, 16) == 12.0  # past the grid: proportional to rows


def test_floor_counts_every_linear_layer_on_the_rows_kvflow_runs_it_on(tmp_path: Path) -> None:
    """Layer 0 runs all four products on every token; the last layer runs only QKV on every token and the rest on
    sampled rows; the LM head on sampled rows. The FLOPs of a pass follow from that exactly."""
    import torch

    from kvflow import LLM

    benchmark = load_benchmark()
    compute_floor = load_compute_floor()
    path = benchmark.ensure_checkpoint(tmp_path / "ckpt", benchmark.QUICK_SHAPE)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    try:
        model = llm.run_in_engine(lambda core: core.executor.worker.model_runner.model)
        floor = compute_floor.GemmFloor.measure(model, [(10, 2)], dtype=torch.float32, repeats=1)
    finally:
        llm.shutdown()
    hidden, inter, vocab = 128, 256, 1000
    qkv = hidden * (hidden + 2 * (hidden // 4) * 2)
    others = hidden * hidden + hidden * 2 * inter + inter * hidden
    expected = 2 * (10 * (2 * qkv + others) + 2 * (others + vocab * hidden))
    assert floor.flops == expected
    assert floor.seconds > 0 and floor.num_passes == 1


def test_floor_uses_the_faster_of_torch_and_the_kvflow_kernel_and_says_which() -> None:
    import torch

    compute_floor = load_compute_floor()
    # float32: no kvflow kernel applies, so torch's product is the floor
    assert compute_floor.time_linear(64, 32, 16, torch.float32, 1, kernel=True) is None
    assert compute_floor.fastest_linear(64, 32, 16, torch.float32, 1)[1] == "torch"
    seconds, source = compute_floor.fastest_linear(64, 32, 16, torch.bfloat16, 1)
    assert seconds > 0 and source in (compute_floor.SOURCE_TORCH, compute_floor.SOURCE_KERNEL)
    shape = compute_floor.GemmShape(8, 4, compute_floor.ROWS_TOKENS)
    floor = compute_floor.GemmFloor(
        1.0,
        2.0,
        1,
        {shape: {1: 0.1, 2: 0.2, 4: 0.3}},
        {shape: {1: "torch", 2: "kvflow kernel", 4: "torch"}},
    )
    assert floor.sources() == ["floor GEMM 8x4 (tokens rows): kvflow kernel at 2; torch at 1,4"]


def test_physical_floor_takes_each_pass_at_the_slower_of_reading_its_weights_and_its_flops(
    tmp_path: Path,
) -> None:
    """A pass costs max(linear weight bytes / read bandwidth, its FLOPs / peak GEMM rate): at 1 GB/s and 100
    GFLOP/s a one-token pass is bound by reading the weights, a 2000-token prompt by its FLOPs, and the sum is
    exact; `measure` takes both rates from this machine."""
    import torch

    from kvflow import LLM

    benchmark = load_benchmark()
    compute_floor = load_compute_floor()
    path = benchmark.ensure_checkpoint(tmp_path / "ckpt", benchmark.QUICK_SHAPE)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    try:
        model = llm.run_in_engine(lambda core: core.executor.worker.model_runner.model)
        passes = [(1, 1), (2000, 1)]
        floor = compute_floor.PhysicalFloor.from_rates(
            model, passes, dtype=torch.float32, read_bytes_per_s=1e9, peak=(1e11, torch.float32)
        )
        measured = compute_floor.PhysicalFloor.measure(
            model, passes, dtype=torch.float32, bandwidth_bytes=2**20, matmul_size=64, repeats=1
        )
    finally:
        llm.shutdown()
    shapes = compute_floor.model_gemm_shapes(model)
    weights = sum(count * shape.out_features * shape.in_features for shape, count in shapes.items())
    assert floor.weight_bytes == 4 * weights
    memory_s = floor.weight_bytes / 1e9
    flops = [compute_floor.pass_flops(shapes, tokens, sampled) for tokens, sampled in passes]
    assert flops[0] / 1e11 < memory_s < flops[1] / 1e11  # one pass of each kind
    assert floor.seconds == memory_s + flops[1] / 1e11
    assert floor.memory_bound_passes == 1 and floor.num_passes == 2 and floor.flops == sum(flops)
    assert "physical floor" in floor.describe() and "1 bound by reading" in floor.describe()
    assert measured.read_bytes_per_s > 0 and measured.peak_flops_per_s > 0
    assert measured.seconds > 0 and measured.peak_dtype is torch.float32
