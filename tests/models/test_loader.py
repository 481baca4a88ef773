"""The safetensors loader: single and sharded checkpoints, clear errors, dtype resolution, weight checks."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow.kernels.build import cpu_feature_flags
from kvflow.models.hf_config import TransformerConfig, load_hf_config
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.loader import (
    cpu_has_native_bf16,
    iterate_safetensors_weights,
    load_model,
    pooling_auto_dtype,
    resolve_dtype,
    resolve_runner_dtype,
)
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _copy_config(source: Path, destination: Path) -> None:
    destination.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "config.json", destination / "config.json")


def _write_sharded(source: Path, destination: Path, num_shards: int = 3) -> dict[str, torch.Tensor]:
    """Split `source`'s single file into `num_shards` files plus an index, as save_pretrained does."""
    state = load_file(str(source / "model.safetensors"))
    _copy_config(source, destination)
    names = sorted(state)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        shard_names = names[shard::num_shards]
        save_file(
            {name: state[name].contiguous() for name in shard_names}, str(destination / file_name)
        )
        weight_map.update(dict.fromkeys(shard_names, file_name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (destination / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


def test_single_file_loads_every_tensor(llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = load_file(str(llama_path / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="kvflow.models.loader"):
        model = load_model(llama_path)
    assert "loaded LlamaForCausalLM" in caplog.text
    assert not model.training and model.dtype == torch.float32
    layer = model.model.layers[1]
    q_size = model.config.num_attention_heads * model.config.head_dim
    torch.testing.assert_close(
        layer.self_attn.qkv_proj.weight[:q_size],
        state["model.layers.1.self_attn.q_proj.weight"],
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        layer.mlp.gate_up_proj.weight[model.config.intermediate_size :],
        state["model.layers.1.mlp.up_proj.weight"],
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(model.lm_head.weight, state["lm_head.weight"], rtol=0, atol=0)


def test_sharded_index_loads_the_same_model(llama_path: Path, tmp_path: Path) -> None:
    state = _write_sharded(llama_path, tmp_path)
    assert {name for name, _ in iterate_safetensors_weights(tmp_path)} == set(state)
    single, sharded = load_model(llama_path), load_model(tmp_path)
    for (name, a), (_, b) in zip(
        single.named_parameters(), sharded.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_missing_shard_names_the_file(llama_path: Path, tmp_path: Path) -> None:
    _write_sharded(llama_path, tmp_path)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003\.safetensors"):
        load_model(tmp_path)


def test_no_weight_files_names_the_folder(llama_path: Path, tmp_path: Path) -> None:
    _copy_config(llama_path, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*" + tmp_path.name):
        list(iterate_safetensors_weights(tmp_path))


def test_corrupt_file_names_the_file(llama_path: Path, tmp_path: Path) -> None:
    _copy_config(llama_path, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(tmp_path)


def test_corrupt_index_names_the_file(llama_path: Path, tmp_path: Path) -> None:
    _copy_config(llama_path, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json"):
        list(iterate_safetensors_weights(tmp_path))


def test_resolve_dtype(llama_path: Path) -> None:
    config = load_hf_config(llama_path)
    assert config.torch_dtype == "float32"
    assert resolve_dtype("auto", config) == torch.float32
    assert resolve_dtype("auto", _with_dtype(config, "bfloat16")) == torch.bfloat16
    assert resolve_dtype("auto", _with_dtype(config, None)) == torch.float32
    assert resolve_dtype("float16", config) == torch.float16
    assert resolve_dtype("bfloat16", config) == torch.bfloat16
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8", config)


@pytest.mark.parametrize(
    ("checkpoint_dtype", "device_type", "native_bf16", "expected"),
    [
        (torch.float32, "cpu", True, torch.bfloat16),  # AVX512_BF16 / AMX: native bf16 products
        (torch.float32, "cpu", False, torch.float32),  # bf16 would be widened in software: slower
        (torch.float32, "cuda", False, torch.float16),  # vLLM's pooling preference on CUDA
        (torch.float32, "cuda", True, torch.float16),
        (torch.bfloat16, "cpu", False, torch.bfloat16),  # a 16-bit checkpoint keeps its dtype
        (torch.bfloat16, "cuda", False, torch.bfloat16),
        (torch.float16, "cpu", True, torch.float16),
    ],
)
def test_pooling_auto_dtype_rule(
    checkpoint_dtype: torch.dtype, device_type: str, native_bf16: bool, expected: torch.dtype
) -> None:
    assert pooling_auto_dtype(checkpoint_dtype, device_type, native_bf16) is expected


def test_resolve_runner_dtype_downcasts_only_pooling_auto(
    llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_hf_config(llama_path)  # float32
    assert cpu_has_native_bf16() == bool({"avx512_bf16", "amx_bf16"} & cpu_feature_flags())
    native = cpu_has_native_bf16()
    with caplog.at_level(logging.INFO, logger="kvflow.models.loader"):
        pooled = resolve_runner_dtype("auto", config, "pooling", "cpu")
    assert pooled is (torch.bfloat16 if native else torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")]
    assert lines == [
        "dtype auto: float32 checkpoint served in bfloat16 (pooling runner, native bf16 on this CPU); pass "
        "dtype='float32' for full precision"
        if native
        else "dtype auto: float32 checkpoint served in float32 (pooling runner, this CPU has no native bf16 "
        "arithmetic)"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvflow.models.loader"):
        assert resolve_runner_dtype("auto", config, "generate", "cpu") is torch.float32
        assert resolve_runner_dtype("float32", config, "pooling", "cpu") is torch.float32
        assert resolve_runner_dtype("float16", config, "pooling", "cpu") is torch.float16
        bf16_config = _with_dtype(config, "bfloat16")
        assert resolve_runner_dtype("auto", bf16_config, "pooling", "cpu") is torch.bfloat16
        # A CUDA device is only named here (no GPU needed): pooling prefers float16 there.
        assert resolve_runner_dtype("auto", config, "pooling", "cuda") is torch.float16
    assert [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()] == [
        "dtype auto: float32 checkpoint served in float16 (pooling runner on CUDA); pass dtype='float32' for "
        "full precision"
    ]


def _with_dtype(config: TransformerConfig, torch_dtype: str | None) -> TransformerConfig:
    return replace(config, torch_dtype=torch_dtype)


def test_load_casts_to_requested_dtype(llama_path: Path) -> None:
    model = load_model(llama_path, dtype="bfloat16")
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    assert model.make_kv_cache(4, 16).dtype == torch.bfloat16


def _fresh(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM(load_hf_config(path), dtype=torch.float32)


def test_missing_parameter_is_named(llama_path: Path) -> None:
    dropped = "model.layers.1.self_attn.k_proj.weight"
    weights = [(n, t) for n, t in iterate_safetensors_weights(llama_path) if n != dropped]
    with pytest.raises(
        ValueError, match=r"missing parameters: model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        _fresh(llama_path).load_weights(weights)


def test_unexpected_parameter_is_named(llama_path: Path) -> None:
    weights = [
        *iterate_safetensors_weights(llama_path),
        ("model.layers.9.mystery.weight", torch.zeros(3)),
    ]
    with pytest.raises(
        ValueError, match=r"unexpected parameters: model\.layers\.9\.mystery\.weight"
    ):
        _fresh(llama_path).load_weights(weights)


def test_shape_mismatch_is_named(llama_path: Path) -> None:
    weights = [
        (n, t[:-1] if n == "model.layers.0.mlp.up_proj.weight" else t)
        for n, t in iterate_safetensors_weights(llama_path)
    ]
    with pytest.raises(
        ValueError, match=r"shape mismatches: model\.layers\.0\.mlp\.up_proj\.weight"
    ):
        _fresh(llama_path).load_weights(weights)


def test_rotary_inv_freq_is_skipped(llama_path: Path) -> None:
    inv_freq = ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))
    weights = [*iterate_safetensors_weights(llama_path), inv_freq]
    _fresh(llama_path).load_weights(weights)


def test_tied_checkpoint_shares_the_embedding(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen2")
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # A tied checkpoint that still ships lm_head.weight loads too (the copy is ignored).
    weights = [*iterate_safetensors_weights(path), ("lm_head.weight", torch.zeros(384, 64))]
    _fresh(path).load_weights(weights)


def test_untied_checkpoint_without_lm_head_ties(
    llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = [(n, t) for n, t in iterate_safetensors_weights(llama_path) if n != "lm_head.weight"]
    model = _fresh(llama_path)
    with caplog.at_level(logging.WARNING):
        model.load_weights(weights)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head" in caplog.text


def test_auto_dtype_follows_the_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen3", dtype="bfloat16", num_hidden_layers=1)
    assert load_hf_config(path).torch_dtype == "bfloat16"
    model = load_model(path)
    assert model.dtype == torch.bfloat16
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}


def test_packed_modules_load_from_separate_checkpoint_tensors(llama_path: Path) -> None:
    """Through `packed_modules_mapping`, q/k/v fill the shards of `qkv_proj` and gate/up those of `gate_up_proj`,
    in mapping order."""
    mapping = LlamaForCausalLM.packed_modules_mapping
    assert mapping == {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    state = dict(iterate_safetensors_weights(llama_path))
    model = _fresh(llama_path)
    model.load_weights(state.items())
    layer = model.model.layers[0]
    for module_name, module, packed in (
        ("self_attn", layer.self_attn, "qkv_proj"),
        ("mlp", layer.mlp, "gate_up_proj"),
    ):
        parts = [state[f"model.layers.0.{module_name}.{part}.weight"] for part in mapping[packed]]
        assert torch.equal(getattr(module, packed).weight, torch.cat(parts))


def test_a_checkpoint_that_ships_the_packed_tensor_loads_it_whole(llama_path: Path) -> None:
    state = dict(iterate_safetensors_weights(llama_path))
    prefix = "model.layers.1.self_attn."
    qkv = torch.cat(
        [state.pop(f"{prefix}{part}.weight") for part in ("q_proj", "k_proj", "v_proj")]
    )
    model = _fresh(llama_path)
    model.load_weights([*state.items(), (f"{prefix}qkv_proj.weight", qkv)])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, qkv)


def test_a_weight_update_goes_through_the_same_weight_loaders(llama_path: Path) -> None:
    model = load_model(llama_path)
    gate_rows = model.config.intermediate_size
    gate = torch.full_like(model.model.layers[0].mlp.gate_up_proj.weight[:gate_rows], 0.5)
    model.load_weights([("model.layers.0.mlp.gate_proj.weight", gate)], strict=False)
    fused = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(fused[:gate_rows], gate)
    with pytest.raises(
        ValueError, match=r"shape mismatches: model\.layers\.0\.mlp\.gate_proj\.weight"
    ):
        model.load_weights([("model.layers.0.mlp.gate_proj.weight", gate[:-1])], strict=False)
