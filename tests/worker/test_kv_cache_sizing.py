"""KV cache sizing: a bounded CPU default (4 GiB or KVFLOW_CPU_KVCACHE_SPACE, at most half the available memory),
the CUDA gpu_memory_utilization arithmetic, the max_num_seqs x max_model_len cap, and clear errors for sizes the
device cannot hold."""

from __future__ import annotations

import logging

import pytest
import torch

from kvflow import LLM
from kvflow.config import GIB, CacheConfig, EngineConfig, SchedulerConfig
from kvflow.core.kv_cache_utils import KVCacheLayout
from kvflow.engine.arg_utils import cpu_kv_cache_space_bytes
from kvflow.utils import cdiv
from kvflow.worker.worker import (
    DeviceMemory,
    cpu_kv_cache_budget,
    cuda_kv_cache_budget,
    measure_device_memory,
    plan_kv_cache,
)

MIB = 1 << 20


def engine_config(
    max_num_seqs: int = 128, max_model_len: int = 2048, block_size: int = 16, **cache: object
) -> EngineConfig:
    return EngineConfig(
        cache_config=CacheConfig(block_size=block_size, **cache),  # type: ignore[arg-type]
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
    )


def kv_cache_bytes(llm: LLM) -> int:
    return llm.run_in_engine(lambda core: core.executor.worker.kv_cache_plan).num_bytes


# ------------------------------------------------------------------------------------------------ arithmetic
def test_cpu_budget_is_the_configured_space_when_memory_is_plentiful() -> None:
    assert cpu_kv_cache_budget(4 * GIB, free_bytes=64 * GIB) == 4 * GIB


def test_cpu_budget_leaves_half_the_available_memory() -> None:
    assert cpu_kv_cache_budget(4 * GIB, free_bytes=6 * GIB) == 3 * GIB


def test_cuda_budget_is_the_utilization_share_minus_memory_in_use() -> None:
    # 80 GiB device, 0.9 may be used (72 GiB); 16 GiB already in use (weights, other processes): 56 GiB.
    assert (
        cuda_kv_cache_budget(80 * GIB, free_bytes=64 * GIB, gpu_memory_utilization=0.9) == 56 * GIB
    )


def test_cuda_budget_is_negative_when_the_device_is_fuller_than_the_share() -> None:
    assert cuda_kv_cache_budget(80 * GIB, free_bytes=4 * GIB, gpu_memory_utilization=0.5) < 0


def test_automatic_cpu_plan_takes_4_gib_when_the_need_is_larger() -> None:
    config = engine_config(max_num_seqs=1024, max_model_len=8192)
    plan = plan_kv_cache(config, MIB, DeviceMemory("cpu", 128 * GIB, 100 * GIB))
    assert plan.num_bytes == 4 * GIB
    assert "KVFLOW_CPU_KVCACHE_SPACE" in plan.rule


def test_automatic_plan_is_capped_at_what_every_slot_needs() -> None:
    config = engine_config(max_num_seqs=4, max_model_len=100, block_size=16)
    plan = plan_kv_cache(config, MIB, DeviceMemory("cpu", 128 * GIB, 100 * GIB))
    assert plan.num_blocks == 4 * cdiv(100, 16)
    assert "max_num_seqs" in plan.rule


def test_automatic_plan_cap_counts_every_kv_cache_group_of_a_sequence() -> None:
    """With sliding-window groups a full-length sequence holds a block per position in its full group and a window
    (plus a prefill chunk) in each sliding group: the cap is what that layout holds, in its (smaller) blocks."""
    layout = KVCacheLayout([64, None] * 4)
    config = engine_config(max_num_seqs=4, max_model_len=1000, block_size=16)
    per_sequence = layout.blocks_per_sequence(1000, 16, chunk_tokens=32)
    assert per_sequence == cdiv(1000, 16) + cdiv(63 + 32, 16) + 1
    plan = plan_kv_cache(
        config, MIB, DeviceMemory("cpu", 128 * GIB, 100 * GIB), blocks_per_sequence=per_sequence
    )
    assert plan.num_blocks == 4 * per_sequence


def test_automatic_cuda_plan_uses_gpu_memory_utilization() -> None:
    config = engine_config(max_num_seqs=1024, max_model_len=32768, gpu_memory_utilization=0.5)
    plan = plan_kv_cache(config, MIB, DeviceMemory("cuda", 80 * GIB, 70 * GIB))
    assert plan.num_bytes == 30 * GIB
    assert "gpu_memory_utilization=0.5" in plan.rule


def test_full_cuda_device_names_gpu_memory_utilization() -> None:
    config = engine_config(gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_cache(config, MIB, DeviceMemory("cuda", 80 * GIB, 10 * GIB))


def test_num_kv_blocks_and_kv_cache_memory_bytes_override_the_budget() -> None:
    memory = DeviceMemory("cpu", 128 * GIB, 100 * GIB)
    assert plan_kv_cache(engine_config(num_kv_blocks=7), MIB, memory).num_blocks == 7
    plan = plan_kv_cache(engine_config(kv_cache_memory_bytes=5 * MIB + 1), MIB, memory)
    assert plan.num_blocks == 5


# ------------------------------------------------------------------------------------------------ impossible sizes
def test_kv_cache_memory_bytes_beyond_free_memory_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000000000000000"):
        LLM("hash", kv_cache_memory_bytes=10**15)


def test_num_kv_blocks_beyond_free_memory_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM("hash", num_kv_blocks=10**15)


# ------------------------------------------------------------------------------------------------ engines
def test_default_model_default_cache_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    free_before = measure_device_memory(torch.device("cpu")).free_bytes
    with caplog.at_level(logging.INFO, logger="kvflow.worker.worker"):
        llm = LLM(device="cpu")
    scheduler_config = llm.engine_config.scheduler_config
    plan = llm.run_in_engine(lambda core: core.executor.worker.kv_cache_plan)
    need_blocks = scheduler_config.max_num_seqs * cdiv(
        scheduler_config.max_model_len, llm.engine_config.cache_config.block_size
    )
    assert plan.num_blocks <= need_blocks
    assert plan.num_bytes <= 4 * GIB
    assert plan.num_bytes <= free_before // 2
    [message] = [record.getMessage() for record in caplog.records if "KV cache:" in record.message]
    assert f"{plan.num_blocks} blocks" in message and "max concurrency" in message


def test_cpu_kvcache_space_env_var_sets_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_CPU_KVCACHE_SPACE", "0.001")  # ~1 MiB
    llm = LLM("hash", device="cpu", max_num_seqs=1024, max_model_len=1024)
    assert 0 < kv_cache_bytes(llm) <= 0.001 * GIB
    assert llm.engine_config.cache_config.cpu_kv_cache_space_bytes == int(0.001 * GIB)


def test_small_cache_warns_that_max_num_seqs_full_sequences_do_not_fit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVFLOW_CPU_KVCACHE_SPACE", "0.001")
    with caplog.at_level(logging.WARNING, logger="kvflow.worker.worker"):
        LLM("hash", device="cpu", max_num_seqs=1024, max_model_len=1024)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "fewer than max_num_seqs=1024" in warning and "KVFLOW_CPU_KVCACHE_SPACE" in warning


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_malformed_cpu_kvcache_space_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="KVFLOW_CPU_KVCACHE_SPACE"):
        cpu_kv_cache_space_bytes({"KVFLOW_CPU_KVCACHE_SPACE": value})


def test_cpu_kvcache_space_parses_gib_and_zero_means_the_default() -> None:
    assert cpu_kv_cache_space_bytes({"KVFLOW_CPU_KVCACHE_SPACE": "2"}) == 2 * GIB
    assert cpu_kv_cache_space_bytes({"KVFLOW_CPU_KVCACHE_SPACE": "0"}) == 4 * GIB
    assert cpu_kv_cache_space_bytes({}) == 4 * GIB


def test_gpu_memory_utilization_is_an_engine_option_validated_on_construction() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM("hash", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM("hash", gpu_memory_utilization="high")
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
