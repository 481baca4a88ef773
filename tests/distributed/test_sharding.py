"""How tensors split across tensor-parallel ranks, checked in one process (no collective runs: each rank's model is
built and loaded with a group that has no process group, which is all construction and loading need)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvflow.config import ParallelConfig
from kvflow.distributed import (
    TensorParallelGroup,
    kv_head_partition,
    split_evenly,
    vocab_partition,
)
from kvflow.executor import get_executor_class, resolve_executor_backend
from kvflow.models.hf_config import load_hf_config
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import iterate_safetensors_weights
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint


def test_partitions() -> None:
    assert [split_evenly(8, 4, rank, "x") for rank in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)",
    ):
        split_evenly(4, 3, 0, "num_attention_heads")
    assert [kv_head_partition(4, 2, rank) for rank in range(2)] == [(0, 2), (2, 2)]
    # Fewer KV heads than ranks: each head is held by the consecutive ranks whose query heads use it.
    assert [kv_head_partition(2, 4, rank) for rank in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(4\) must divide num_key_value_heads \(3\)"
    ):
        kv_head_partition(3, 4, 0)
    # 385 tokens over 2 ranks: 193 rows each, the last one padding on rank 1.
    assert [vocab_partition(385, 2, rank) for rank in range(2)] == [(0, 193, 193), (193, 192, 193)]


def test_executor_backend_defaults_and_registry() -> None:
    assert resolve_executor_backend(ParallelConfig()) == "uni"
    assert resolve_executor_backend(ParallelConfig(tensor_parallel_size=2)) == "mp"
    assert resolve_executor_backend(ParallelConfig(2, "ray")) == "ray"
    assert get_executor_class("mp").name == "mp"
    with pytest.raises(ValueError, match="'uni' runs a single rank; tensor_parallel_size=2"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="unknown distributed_executor_backend 'mpi'"):
        get_executor_class("mpi")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # vocab 385 does not divide by 2 (padding), qwen2 has q/k/v biases and tied embeddings
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen2"), "qwen2", vocab_size=385, num_key_value_heads=2
    )


def _full_tensors(path: Path) -> dict[str, torch.Tensor]:
    return dict(iterate_safetensors_weights(path))


@pytest.mark.parametrize("rank", [0, 1])
def test_the_loader_reads_only_each_ranks_shards(checkpoint: Path, rank: int) -> None:
    config = load_hf_config(checkpoint)
    model = LlamaForCausalLM(config, dtype=torch.float32, tp=TensorParallelGroup(rank, 2))
    shards = list(iterate_safetensors_weights(checkpoint, model.checkpoint_index))
    full = _full_tensors(checkpoint)
    read = {name: tensor for name, tensor in shards}
    # What the rank read: half the rows of q/k/v (and their biases), gate, up and the vocabulary, half the
    # columns of o and down; norms whole.
    assert read["model.layers.0.self_attn.q_proj.weight"].shape == (32, 64)
    assert read["model.layers.0.self_attn.k_proj.bias"].shape == (16,)
    assert read["model.layers.0.self_attn.o_proj.weight"].shape == (64, 32)
    assert read["model.layers.0.mlp.down_proj.weight"].shape == (64, 64)
    assert read["model.embed_tokens.weight"].shape == (193 - rank, 64)
    assert read["model.norm.weight"].shape == (64,)
    assert sum(t.numel() for t in read.values()) < 0.6 * sum(t.numel() for t in full.values())
    torch.testing.assert_close(
        read["model.layers.1.mlp.gate_proj.weight"],
        full["model.layers.1.mlp.gate_proj.weight"][rank * 64 : (rank + 1) * 64],
        rtol=0,
        atol=0,
    )
    model.load_weights(shards, sliced=True)
    # Whole tensors (a state-dict update) are cut to the same shards.
    other = LlamaForCausalLM(config, dtype=torch.float32, tp=TensorParallelGroup(rank, 2))
    other.load_weights(full.items())
    for (name, mine), (_, theirs) in zip(
        model.state_dict().items(), other.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    embedding = model.model.embed_tokens.weight
    assert embedding.shape == (193, 64) and model.lm_head.weight is embedding
    if rank == 1:
        assert torch.count_nonzero(embedding[192]) == 0  # the padding row
    assert model.num_kv_heads == 1
    assert model.kv_cache_bytes_per_block(4) * 2 == LlamaForCausalLM(
        config, dtype=torch.float32
    ).kv_cache_bytes_per_block(4)


def test_one_rank_reads_whole_tensors(checkpoint: Path) -> None:
    model = LlamaForCausalLM(load_hf_config(checkpoint), dtype=torch.float32)
    assert model.checkpoint_index("model.layers.0.self_attn.q_proj.weight") == ()
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        assert tuple(handle.get_slice("model.embed_tokens.weight").get_shape()) == (385, 64)
    assert model.model.embed_tokens.weight.shape == (385, 64)


def test_head_counts_that_do_not_split_are_value_errors(checkpoint: Path) -> None:
    config = load_hf_config(checkpoint)
    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)",
    ):
        LlamaForCausalLM(config, dtype=torch.float32, tp=TensorParallelGroup(0, 3))


def test_cpu_kv_cache_budget_is_split_between_ranks_so_tp_holds_as_many_blocks() -> None:
    """Each rank's block is 1/N of one rank's bytes and the host's budget is split N ways: the same block count."""
    from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvflow.worker.worker import DeviceMemory, plan_kv_cache

    config = EngineConfig(
        cache_config=CacheConfig(cpu_kv_cache_space_bytes=1 << 20),
        scheduler_config=SchedulerConfig(max_num_seqs=64, max_model_len=8192),
    )
    memory = DeviceMemory("cpu", total_bytes=1 << 34, free_bytes=1 << 33)
    one_rank = plan_kv_cache(config, 4096, memory)
    two_ranks = plan_kv_cache(config, 2048, memory, num_host_ranks=2)
    assert one_rank.num_blocks == two_ranks.num_blocks == (1 << 20) // 4096
    assert "split between 2 ranks" in two_ranks.rule


def test_column_slices_are_read_in_chunks_no_larger_than_the_part(tmp_path: Path) -> None:
    """A row-parallel rank's columns: equal to slicing the whole tensor, read a few rows at a time."""
    from safetensors.torch import save_file

    from kvflow.models.safetensors_io import SafetensorsFile

    weight = torch.randn(37, 20, dtype=torch.float32)
    save_file({"w": weight, "b": torch.randn(5)}, str(tmp_path / "x.safetensors"))
    with SafetensorsFile(tmp_path / "x.safetensors") as handle:
        reads: list[int] = []
        read_exactly = handle._read_exactly

        def counting(tensor: torch.Tensor, offset: int, name: str) -> None:
            reads.append(tensor.numel())
            read_exactly(tensor, offset, name)

        handle._read_exactly = counting  # type: ignore[method-assign]
        part = handle.read("w", (slice(None), slice(10, 15)))
        assert torch.equal(part, weight[:, 10:15])
        assert max(reads) <= part.numel() and sum(reads) == weight.numel()
        assert torch.equal(handle.read("w", (slice(3, 9), slice(0, 20, 2))), weight[3:9, ::2])
