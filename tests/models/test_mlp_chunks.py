"""`GatedMLP` above `MLP_CHUNK_BYTES` of gate/up product runs in row chunks (each chunk's product stays under the
budget), and every row's result is the one the whole step gives, bit for bit; smaller steps run in one pass."""

from __future__ import annotations

import pytest
import torch

from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.models.hf_config import parse_hf_config
from kvflow.models.layers.mlp import MLP_CHUNK_BYTES, MLP_CHUNK_MIN_ROWS, GatedMLP

# Qwen2-0.5B's feed-forward width (the benchmark's shape) on a narrow hidden size, to keep the products quick.
INTERMEDIATE = 4864


def _mlp(dtype: torch.dtype) -> GatedMLP:
    config = parse_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "hidden_act": "silu",
        }
    )
    mlp = GatedMLP(config, dtype=dtype, device=torch.device("cpu"), tp=TensorParallelGroup.single())
    generator = torch.Generator().manual_seed(0)
    for parameter in (mlp.gate_up_proj.weight, mlp.down_proj.weight):
        parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return mlp


def _rows_seen(mlp: GatedMLP, hidden: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The block's output and the row count of every gate/up product it ran."""
    seen: list[int] = []
    hook = mlp.gate_up_proj.register_forward_hook(
        lambda module, args, output: seen.append(args[0].shape[0])
    )
    try:
        return mlp(hidden), seen
    finally:
        hook.remove()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [2048, 1500])
def test_large_steps_run_in_row_chunks_with_the_whole_steps_result(
    dtype: torch.dtype, num_rows: int
) -> None:
    mlp = _mlp(dtype)
    hidden = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(num_rows)).to(dtype)
    row_bytes = 2 * INTERMEDIATE * hidden.element_size()
    assert num_rows * row_bytes > MLP_CHUNK_BYTES  # the whole step's product is over the budget
    with torch.inference_mode():
        output, seen = _rows_seen(mlp, hidden)
        whole = mlp.down_proj(mlp.activation(mlp.gate_up_proj(hidden)))
    assert len(seen) > 1 and sum(seen) == num_rows
    assert all(rows >= MLP_CHUNK_MIN_ROWS and rows * row_bytes <= MLP_CHUNK_BYTES for rows in seen)
    assert output.shape == whole.shape and output.dtype == dtype
    assert torch.equal(output, whole)


def test_steps_under_the_budget_run_in_one_pass() -> None:
    mlp = _mlp(torch.bfloat16)
    num_rows = MLP_CHUNK_BYTES // (2 * INTERMEDIATE * 2)
    hidden = torch.randn(num_rows, 64).bfloat16()
    with torch.inference_mode():
        _, seen = _rows_seen(mlp, hidden)
    assert seen == [num_rows]
