"""The registry builds every model, the hash model included, from its `ModelInfo.architecture`: one `LazyRegistry`
table of import paths, so the registries import no model and nothing imports them back."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow.config import ModelConfig
from kvflow.model_info import resolve_model_info
from kvflow.models.hash_model import HashModel
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.registry import (
    HASH_MODEL_ARCHITECTURE,
    MODEL_REGISTRY,
    SUPPORTED_ARCHITECTURES,
    build_model,
    get_model_class,
)
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

CPU = torch.device("cpu")

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


def test_the_hash_model_is_built_through_the_registry() -> None:
    model_info = resolve_model_info("hash")
    assert model_info.architecture == HASH_MODEL_ARCHITECTURE and model_info.is_hash_model
    model = build_model(ModelConfig(model="hash"), model_info, CPU)
    assert isinstance(model, HashModel)
    assert model.vocab_size == model_info.vocab_size
    assert model.samples_own_tokens


def test_a_checkpoint_is_built_by_its_architecture(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model_info = resolve_model_info(str(checkpoint))
    assert model_info.architecture == "Qwen2ForCausalLM" and not model_info.is_hash_model
    model = build_model(ModelConfig(model=str(checkpoint), dtype="float32"), model_info, CPU)
    assert isinstance(model, LlamaForCausalLM)
    assert not model.samples_own_tokens


def test_an_unknown_architecture_is_refused_by_name() -> None:
    model_info = dataclasses.replace(resolve_model_info("hash"), architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        build_model(ModelConfig(model="hash"), model_info, CPU)


def test_the_hash_model_has_no_weights_to_load() -> None:
    with pytest.raises(ValueError, match="the hash test model has no weights to update"):
        HashModel().load_weights([], strict=False)


def test_every_architecture_names_its_class() -> None:
    """The Llama family runs on `LlamaForCausalLM`; each other family on its own class, named as its architecture."""
    llama_family = SUPPORTED_ARCHITECTURES[:4]
    assert llama_family == (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
    )
    assert "Phi3ForCausalLM" in SUPPORTED_ARCHITECTURES
    for architecture in SUPPORTED_ARCHITECTURES:
        model_class = MODEL_REGISTRY.get(architecture)
        assert get_model_class([architecture]) is model_class
        if architecture in llama_family:
            assert model_class is LlamaForCausalLM
        else:
            assert model_class.__name__ == _POOLING_CLASSES.get(architecture, architecture)
    assert MODEL_REGISTRY.get(HASH_MODEL_ARCHITECTURE) is HashModel
    assert HASH_MODEL_ARCHITECTURE not in SUPPORTED_ARCHITECTURES
    with pytest.raises(ValueError, match="unknown model architecture 'GPT2LMHeadModel'"):
        MODEL_REGISTRY.get("GPT2LMHeadModel")


def test_a_checkpoint_cannot_name_the_hash_model() -> None:
    with pytest.raises(
        ValueError, match=r"unsupported model architecture 'HashModel'; supported: Llama"
    ):
        get_model_class([HASH_MODEL_ARCHITECTURE])


@pytest.mark.parametrize("module", ["registry.py", "attention/registry.py"])
def test_registries_import_no_model(module: str) -> None:
    """A registry holds names and import paths only (what a backend or model imports can never cycle back)."""
    import kvflow.models

    tree = ast.parse((Path(kvflow.models.__file__).parent / module).read_text())
    imported = [
        node.module or ""
        for node in tree.body  # module level; TYPE_CHECKING blocks are `if` nodes, not in this list
        if isinstance(node, ast.ImportFrom)
    ]
    assert imported and not [name for name in imported if name.startswith("kvflow.models")]


def test_model_info_imports_no_model() -> None:
    """`kvflow.model_info` (what the engine knows of a model before it starts) imports no model module, the
    registry included: the hash models' architecture keys live below both, in `kvflow.builtin_models`."""
    probe = "import sys, kvflow.model_info; print([n for n in sys.modules if n.startswith('kvflow.models')])"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"
