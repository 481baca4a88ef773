"""benchmarks/kernel_build_ab.py: a baseline kernel build loads beside this tree's, the replay really switches
every kernel user to it and back, and the report has both builds' figures. Structural checks only (no timing
assertions: CI machines are noisy)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from kvflow.kernels import load_cpu_kernels
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("kernel_ab") / "llama",
        "llama",
        seed=3,
        dtype="bfloat16",
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
    )


def test_replay_runs_every_forward_on_the_build_it_names(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    benchmark = importlib.import_module("benchmarks.kernel_build_ab")
    # The baseline: this tree's own build (another commit's would be another module, a build of other sources;
    # the same library file loads as the same module, so this checks the switching, not two builds' speed).
    library = benchmark.build_of(REPO)
    assert library.is_file() and library.suffix == ".so"
    baseline = benchmark.import_build(library)
    assert hasattr(baseline, "decode_layer_quantized")
    seen: list[str] = []
    original_use = benchmark.KernelSwitch.use

    def use(self: Any, build: Any, name: str) -> None:
        original_use(self, build, name)
        # Every switched user now goes through the switch's loader to `build`, and the fused layers hold it.
        from kvflow.kernels import quant

        assert quant.load_cpu_kernels is not self._loader
        assert quant.load_cpu_kernels() is build
        assert self._holders and all(holder._ops is build for holder in self._holders)
        seen.append(name)

    monkeypatch.setattr(benchmark.KernelSwitch, "use", use)
    from kvflow import LLM

    llm = LLM(
        model=str(checkpoint),
        quantization="int8",
        max_num_seqs=1,
        max_model_len=256,
        skip_tokenizer_init=True,
    )
    try:
        results = benchmark.replay_ab(llm, baseline, blocks=4, block=3, warmup=1)
        from kvflow.kernels import build as kernel_build
        from kvflow.kernels import quant

        assert quant.load_cpu_kernels is kernel_build.load_cpu_kernels  # restored
    finally:
        llm.shutdown()
    assert seen == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert results["A_ms"] > 0 and results["B_ms"] > 0
    assert len(results["block_ratios"]) == 4
