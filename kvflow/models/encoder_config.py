"""A BERT / XLM-RoBERTa `config.json` as the encoder runs it (`EncoderConfig`), read without torch: the model
(`kvflow.models.bert`) and the model info (`kvflow.model_info`) both read it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The encoder checkpoints kvflow runs (their config.json is not a decoder's).
ENCODER_ARCHITECTURES = (
    "BertModel",
    "XLMRobertaModel",
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
# The activations the encoder's feed-forward block runs (`kvflow.models.bert` maps each to its function).
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class EncoderConfig:
    """The fields of a BERT / XLM-RoBERTa `config.json` the encoder runs on.

    Invariants: `hidden_size` is a multiple of `num_attention_heads`; `position_offset` is the first position id
    (0 for BERT; `pad_token_id + 1` for XLM-RoBERTa, whose positions skip the padding index), so a sequence may be
    at most `max_position_embeddings - position_offset` tokens long; `hidden_act` is a key of `ENCODER_ACTIVATIONS`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    position_offset: int
    num_labels: int
    torch_dtype: str | None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_seq_len(self) -> int:
        return self.max_position_embeddings - self.position_offset


def parse_encoder_config(raw: dict[str, Any]) -> EncoderConfig:
    """An `EncoderConfig` from a parsed `config.json`; a setting the encoder does not run is a ValueError naming
    the field."""
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in ENCODER_ARCHITECTURES:
        raise ValueError(
            f"architectures: {architecture!r} is not an encoder kvflow runs; "
            f"supported: {', '.join(ENCODER_ARCHITECTURES)}"
        )
    _check_supported(raw)
    hidden_size = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
        )
    is_xlm_roberta = architecture.startswith("XLMRoberta")
    raw_pad = raw.get("pad_token_id")
    pad_token_id = int(raw_pad) if raw_pad is not None else (1 if is_xlm_roberta else 0)
    id2label = raw.get("id2label")
    return EncoderConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=num_heads,
        intermediate_size=int(raw["intermediate_size"]),
        hidden_act=str(raw.get("hidden_act", "gelu")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        pad_token_id=pad_token_id,
        position_offset=pad_token_id + 1 if is_xlm_roberta else 0,
        num_labels=len(id2label) if id2label else int(raw.get("num_labels", 2)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def _check_supported(raw: dict[str, Any]) -> None:
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(
            f"position_embedding_type {position_type!r} is not supported (only 'absolute')"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if raw.get(flag):
            raise ValueError(f"{flag}: true is not supported (kvflow runs BERT as an encoder only)")
    hidden_act = raw.get("hidden_act", "gelu")
    if hidden_act not in ENCODER_ACTIVATIONS:
        raise ValueError(
            f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(ENCODER_ACTIVATIONS)}"
        )
    problem_type = raw.get("problem_type")
    if problem_type not in (
        None,
        "single_label_classification",
        "multi_label_classification",
        "regression",
    ):
        raise ValueError(f"problem_type {problem_type!r} is not supported")


def load_encoder_config(model_path: str | Path) -> EncoderConfig:
    """The `EncoderConfig` of checkpoint folder `model_path` (its config.json)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{model_path} has no config.json")
    return parse_encoder_config(json.loads(config_file.read_text()))
