"""An architecture kvflow does not run fails with the supported list, whatever keys its config.json lacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM
from kvflow.models.hf_config import load_hf_config

GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 768,
    "n_layer": 12,
}
LLAMA_SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_unsupported_architecture_without_llama_keys_names_the_supported_ones(
    tmp_path: Path,
) -> None:
    folder = write_config(tmp_path / "gpt2", GPT2_CONFIG)
    with pytest.raises(
        ValueError,
        match=r"config\.json.*unsupported model architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM",
    ):
        LLM(str(folder))


def test_unsupported_architecture_is_reported_before_missing_keys(tmp_path: Path) -> None:
    without_hidden_size = {k: v for k, v in LLAMA_SHAPE.items() if k != "hidden_size"}
    folder = write_config(
        tmp_path / "bert", {"architectures": ["BertModel"], **without_hidden_size}
    )
    with pytest.raises(ValueError, match="unsupported model architecture 'BertModel'"):
        load_hf_config(folder)


def test_the_first_supported_architecture_in_the_list_is_used(tmp_path: Path) -> None:
    folder = write_config(
        tmp_path / "mixed", {"architectures": ["SomethingElse", "Qwen2ForCausalLM"], **LLAMA_SHAPE}
    )
    assert load_hf_config(folder).architecture == "Qwen2ForCausalLM"
