"""Unit tests for kvflow.config: frozen engine configuration dataclasses and their validation."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvflow.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig


# -------------------------------------------------------------------------------------------------- defaults
def test_model_config_defaults():
    config = ModelConfig()
    assert (config.model, config.tokenizer, config.dtype, config.max_model_len, config.seed) == (
        None,
        None,
        "auto",
        None,
        0,
    )
    assert config.skip_tokenizer_init is False


def test_cache_config_defaults():
    config = CacheConfig()
    assert (config.block_size, config.num_kv_blocks, config.kv_cache_memory_bytes) == (
        16,
        None,
        None,
    )
    assert config.enable_prefix_caching is True


def test_scheduler_config_defaults():
    config = SchedulerConfig()
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (
        128,
        8192,
        8192,
    )
    assert (config.enable_chunked_prefill, config.long_prefill_token_threshold, config.policy) == (
        True,
        0,
        "fcfs",
    )
    assert (config.async_scheduling, config.use_v2_model_runner) == (False, True)


def test_parallel_config_defaults():
    config = ParallelConfig()
    assert (config.tensor_parallel_size, config.distributed_executor_backend) == (1, None)


def test_engine_config_default_sub_configs():
    config = EngineConfig()
    assert config.model_config == ModelConfig()
    assert config.cache_config == CacheConfig()
    assert config.scheduler_config == SchedulerConfig()
    assert config.parallel_config == ParallelConfig()


def test_engine_config_keeps_given_sub_config():
    assert EngineConfig(cache_config=CacheConfig(block_size=32)).cache_config.block_size == 32
    assert EngineConfig().cache_config.block_size == 16


def test_hash_model_flag():
    assert ModelConfig(model="hash").is_hash_model
    assert not ModelConfig().is_hash_model


# ---------------------------------------------------------------------------------------------------- frozen
@pytest.mark.parametrize(
    ("config", "field_name", "value"),
    [
        (ModelConfig(), "max_model_len", 4096),
        (CacheConfig(), "block_size", 32),
        (SchedulerConfig(), "max_num_seqs", 1),
        (ParallelConfig(), "tensor_parallel_size", 2),
        (EngineConfig(), "cache_config", CacheConfig()),
    ],
)
def test_config_is_frozen(config, field_name, value):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field_name, value)


def test_replace_revalidates():
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(CacheConfig(), block_size=0)


def test_configs_are_hashable_and_comparable():
    assert hash(CacheConfig(block_size=8)) == hash(CacheConfig(block_size=8))
    assert CacheConfig(block_size=8) != CacheConfig(block_size=16)


# ----------------------------------------------------------------------------------------------- valid values
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_model_config_accepts_dtypes(dtype):
    assert ModelConfig(dtype=dtype).dtype == dtype


@pytest.mark.parametrize(
    ("config_class", "kwargs"),
    [
        (ModelConfig, {"max_model_len": 2}),
        (CacheConfig, {"block_size": 1}),
        (CacheConfig, {"num_kv_blocks": 1}),
        (CacheConfig, {"kv_cache_memory_bytes": 1}),
        (SchedulerConfig, {"max_num_seqs": 1}),
        (SchedulerConfig, {"max_num_batched_tokens": 1}),
        (SchedulerConfig, {"max_model_len": 2}),
        (SchedulerConfig, {"long_prefill_token_threshold": 0}),
        (SchedulerConfig, {"policy": "priority"}),
        (
            SchedulerConfig,
            {
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": 8192,
                "max_model_len": 8192,
            },
        ),
        (ParallelConfig, {"tensor_parallel_size": 1}),
    ],
)
def test_boundary_values_are_accepted(config_class, kwargs):
    config = config_class(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


# --------------------------------------------------------------------------------------------- invalid values
@pytest.mark.parametrize(
    ("config_class", "field_name", "value"),
    [
        (ModelConfig, "dtype", "float8"),
        (ModelConfig, "max_model_len", 1),
        (ModelConfig, "max_model_len", 0),
        (CacheConfig, "block_size", 0),
        (CacheConfig, "num_kv_blocks", 0),
        (CacheConfig, "kv_cache_memory_bytes", 0),
        (CacheConfig, "kv_cache_memory_bytes", -1),
        (SchedulerConfig, "max_num_seqs", 0),
        (SchedulerConfig, "max_num_batched_tokens", 0),
        (SchedulerConfig, "max_model_len", 1),
        (SchedulerConfig, "long_prefill_token_threshold", -1),
        (ParallelConfig, "tensor_parallel_size", 0),
    ],
)
def test_invalid_value_raises_value_error_naming_field(config_class, field_name, value):
    with pytest.raises(ValueError, match=rf"\b{re.escape(field_name)}\b"):
        config_class(**{field_name: value})


def test_invalid_policy_raises_value_error_naming_policy():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]


def test_no_chunked_prefill_requires_batch_to_fit_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(
            enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=2048
        )


def test_chunked_prefill_allows_batch_smaller_than_max_model_len():
    config = SchedulerConfig(
        enable_chunked_prefill=True, max_num_batched_tokens=1024, max_model_len=2048
    )
    assert config.max_num_batched_tokens == 1024
