"""The per-parameter weight-loading seam: every parameter carries its layer's `weight_loader`, which cuts this
rank's part of a checkpoint tensor, places it (a packed layer's shard) and refuses a shape that does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvflow.distributed import TensorParallelGroup
from kvflow.models.hf_config import load_hf_config
from kvflow.models.layers import ColumnParallelLinear, RowParallelLinear, VocabEmbedding
from kvflow.models.layers.weights import RankPart, WeightShapeError
from kvflow.models.llama import LlamaForCausalLM
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint


class _NoCollective(TensorParallelGroup):
    """A rank of a group without a process group whose all-reduce returns its input: each rank's partial result."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("rank", [None, 0, 1])
def test_every_parameter_carries_a_weight_loader(
    tmp_path: Path, architecture: str, rank: int | None
) -> None:
    config = load_hf_config(make_tiny_checkpoint(tmp_path, architecture))
    tp = None if rank is None else TensorParallelGroup(rank, 2)
    model = LlamaForCausalLM(config, dtype=torch.float32, tp=tp)
    for name, param in model.named_parameters():
        assert callable(getattr(param, "weight_loader", None)), name
    assert model.lm_head.weight.weight_loader is not None  # tied or not, the head has one too


def test_column_parallel_weight_loader_takes_its_rows_of_the_shard() -> None:
    # rank 1 of 2 of a q (8 rows) / k (4 rows) stack: rows 4..8 of q and 2..4 of k
    layer = ColumnParallelLinear(3, [(4, 4), (2, 2)], bias=True, dtype=torch.float32, device="cpu")
    q = torch.arange(24, dtype=torch.float32).view(8, 3)
    k = -torch.arange(12, dtype=torch.float32).view(4, 3)
    layer.weight.weight_loader(layer.weight, q, 0)
    layer.weight.weight_loader(layer.weight, k, 1)
    assert torch.equal(layer.weight, torch.cat([q[4:], k[2:]]))
    layer.bias.weight_loader(layer.bias, torch.arange(4.0), 1)
    assert torch.equal(layer.bias[4:], torch.tensor([2.0, 3.0]))
    # A part already read for this rank is taken as it is.
    layer.weight.weight_loader(layer.weight, RankPart(torch.ones(2, 3)), 1)
    assert torch.equal(layer.weight[4:], torch.ones(2, 3))


def test_a_shape_that_does_not_fit_copies_nothing() -> None:
    layer = ColumnParallelLinear(3, [(0, 4), (0, 2)], bias=False, dtype=torch.float32, device="cpu")
    layer.weight.data.fill_(7.0)
    with pytest.raises(WeightShapeError, match=r"checkpoint \(2, 4\), model \(2, 3\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(2, 4), 1)
    assert bool((layer.weight == 7.0).all())


def test_vocab_weight_loader_takes_the_ranks_vocabulary_rows() -> None:
    # 5 tokens over 2 ranks: rank 1 holds tokens 3 and 4, then one padding row
    embedding = VocabEmbedding(
        5, 2, dtype=torch.float32, device="cpu", tp=TensorParallelGroup(1, 2)
    )
    table = torch.arange(10, dtype=torch.float32).view(5, 2)
    embedding.weight.weight_loader(embedding.weight, table)
    assert torch.equal(embedding.weight, torch.cat([table[3:], torch.zeros(1, 2)]))


def test_row_parallel_ranks_hold_the_bias_and_only_the_first_adds_it() -> None:
    """Two ranks' partial products (their input columns, the bias on the first) sum to the whole layer."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(3, 8, generator=generator), torch.randn(3, generator=generator)
    x = torch.randn(5, 8, generator=generator)
    partials = []
    for rank in range(2):
        layer = RowParallelLinear(
            (4 * rank, 4),
            3,
            bias=True,
            tp=_NoCollective(rank, 2),
            dtype=torch.float32,
            device="cpu",
        )
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.weight_loader(layer.bias, bias)
        assert torch.equal(layer.bias, bias) and layer.adds_bias == (rank == 0)
        partials.append(layer(x[:, 4 * rank : 4 * rank + 4]))
    torch.testing.assert_close(partials[0] + partials[1], F.linear(x, weight, bias))
