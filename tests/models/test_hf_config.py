"""Parsing config.json: both RoPE styles, per-architecture flags, and errors that name the file or key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.models.hf_config import (
    ARCHITECTURE_RULES,
    SLIDING_ATTENTION,
    TransformerConfig,
    load_hf_config,
)
from kvflow.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

# Pooling architectures that run on a class named otherwise: base decoders on the causal LM (its head unused),
# decoder classifiers on one Llama-family classifier, BERT and XLM-RoBERTa encoders on one encoder.
_POOLING_CLASSES = {
    "LlamaModel": "LlamaForCausalLM",
    "Qwen2Model": "LlamaForCausalLM",
    "Qwen3Model": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "LlamaForSequenceClassification",
    "Qwen3ForSequenceClassification": "LlamaForSequenceClassification",
    "BertModel": "BertEncoderModel",
    "XLMRobertaModel": "BertEncoderModel",
}


def _write(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _base(architecture: str = "LlamaForCausalLM", **extra: Any) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        **extra,
    }


def test_old_style_rope_keys(tmp_path: Path) -> None:
    scaling = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = load_hf_config(
        _write(
            tmp_path,
            _base(
                rope_theta=500000.0,
                rope_scaling=scaling,
                torch_dtype="bfloat16",
                eos_token_id=[1, 2],
            ),
        )
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.torch_dtype == "bfloat16"
    assert config.eos_token_id == [1, 2]


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    raw = _base(
        rope_parameters={"rope_type": "linear", "rope_theta": 1234.0, "factor": 2.0},
        dtype="float16",
    )
    config = load_hf_config(_write(tmp_path, raw))
    assert config.rope_theta == 1234.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.torch_dtype == "float16"


@pytest.mark.parametrize(
    "raw_rope",
    [
        {},
        {"rope_theta": 10000.0, "rope_scaling": None},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ],
)
def test_default_rope_has_no_scaling(tmp_path: Path, raw_rope: dict[str, Any]) -> None:
    config = load_hf_config(_write(tmp_path, _base(**raw_rope)))
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is None


def test_defaults_and_derived_fields(tmp_path: Path) -> None:
    config = load_hf_config(_write(tmp_path, _base()))
    assert isinstance(config, TransformerConfig)
    assert (config.num_key_value_heads, config.head_dim) == (4, 16)
    assert not (config.attention_bias or config.o_proj_bias or config.mlp_bias or config.qk_norm)
    assert config.sliding_window is None and config.tie_word_embeddings is False
    assert config.torch_dtype is None and config.bos_token_id is None


def test_explicit_head_dim_and_qwen3_qk_norm(tmp_path: Path) -> None:
    config = load_hf_config(
        _write(tmp_path, _base("Qwen3ForCausalLM", head_dim=32, num_key_value_heads=2))
    )
    assert config.head_dim == 32
    assert config.qk_norm and not config.attention_bias


def test_qwen2_has_qkv_bias_only(tmp_path: Path) -> None:
    config = load_hf_config(_write(tmp_path, _base("Qwen2ForCausalLM")))
    assert config.attention_bias and not config.o_proj_bias


def test_llama_attention_bias_covers_o_proj(tmp_path: Path) -> None:
    config = load_hf_config(_write(tmp_path, _base(attention_bias=True, mlp_bias=True)))
    assert config.attention_bias and config.o_proj_bias and config.mlp_bias


def test_sliding_window_rules(tmp_path: Path) -> None:
    mistral = load_hf_config(
        _write(tmp_path / "m", _base("MistralForCausalLM", sliding_window=4096))
    )
    assert mistral.sliding_window == 4096
    assert mistral.layer_sliding_window(0) == mistral.layer_sliding_window(1) == 4096
    qwen2_off = load_hf_config(
        _write(tmp_path / "q", _base("Qwen2ForCausalLM", sliding_window=4096))
    )
    assert qwen2_off.sliding_window is None and qwen2_off.layer_sliding_window(1) is None
    qwen2_on = load_hf_config(
        _write(
            tmp_path / "q2",
            _base(
                "Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True, max_window_layers=1
            ),
        )
    )
    assert qwen2_on.sliding_window == 64
    assert qwen2_on.layer_types[1] == SLIDING_ATTENTION
    assert (qwen2_on.layer_sliding_window(0), qwen2_on.layer_sliding_window(1)) == (None, 64)


def test_missing_folder_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_config(missing)


def test_missing_config_json_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_config(tmp_path)


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json.*not valid JSON"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "architectures"])
def test_missing_required_key_names_key_and_file(tmp_path: Path, key: str) -> None:
    raw = _base()
    del raw[key]
    with pytest.raises(ValueError, match=rf"config\.json.*{key}"):
        load_hf_config(_write(tmp_path, raw))


def test_registry_maps_every_supported_architecture() -> None:
    """Llama, Qwen2, Qwen3 and Mistral run on `LlamaForCausalLM`; any other family on its own class, named as its
    architecture."""
    from kvflow.models.llama import LlamaForCausalLM

    llama_family = {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
    }
    for architecture in SUPPORTED_ARCHITECTURES:
        model_class = get_model_class([architecture])
        if architecture in llama_family:
            assert model_class is LlamaForCausalLM
        else:
            assert model_class.__name__ == _POOLING_CLASSES.get(architecture, architecture)
    assert get_model_class(["SomethingElse", "MistralForCausalLM"]) is LlamaForCausalLM


def test_registry_rejects_unsupported_architecture() -> None:
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])


def test_every_architecture_with_config_rules_is_registered() -> None:
    """A rule for an architecture the registry does not run would never apply."""
    assert set(ARCHITECTURE_RULES) <= set(SUPPORTED_ARCHITECTURES)
