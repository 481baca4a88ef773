"""kvflow's BERT / XLM-RoBERTa encoders and classifiers (`kvflow.models.bert`) against transformers on tiny random
checkpoints: hidden states, mean / CLS pooling, token types, padded batches, classification logits, bfloat16,
batch invariance and config errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.models.bert import (
    BertEncoderModel,
    BertForSequenceClassification,
    XLMRobertaForSequenceClassification,
    load_encoder_model,
    parse_encoder_config,
)

transformers = pytest.importorskip("transformers")

_SHAPE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "initializer_range": 0.2,
}
# (transformers config class, model class, settings) per checkpoint kind.
_KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertModel", {"type_vocab_size": 2, "pad_token_id": 0}),
    "xlmr": ("XLMRobertaConfig", "XLMRobertaModel", {"type_vocab_size": 1, "pad_token_id": 1}),
    "bert_cls": (
        "BertConfig",
        "BertForSequenceClassification",
        {"type_vocab_size": 2, "pad_token_id": 0, "num_labels": 3},
    ),
    "xlmr_cls": (
        "XLMRobertaConfig",
        "XLMRobertaForSequenceClassification",
        {"type_vocab_size": 1, "pad_token_id": 1, "num_labels": 1},
    ),
}
_SEQ_LENS = (7, 1, 19, 12)
_ATOL = 1e-5


def _make_checkpoint(folder: Path, kind: str, seed: int = 0) -> Path:
    config_class, model_class, settings = _KINDS[kind]
    config = getattr(transformers, config_class)(**_SHAPE, **settings)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config)
        with (
            torch.no_grad()
        ):  # LayerNorms start at ones / zeros: perturb them so ignoring one shows
            for name, param in model.named_parameters():
                if "LayerNorm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
                elif name.endswith(".bias"):
                    param.copy_(torch.randn_like(param) * 0.2)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {kind: _make_checkpoint(root / kind, kind) for kind in _KINDS}


def _hf_model(path: Path, kind: str) -> Any:
    model_class = _KINDS[kind][1]
    return getattr(transformers, model_class).from_pretrained(str(path), dtype=torch.float32).eval()


def _sequences(kind: str, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    low = 2 if kind.startswith("xlmr") else 1  # no padding token inside a real sequence
    return [torch.randint(low, _SHAPE["vocab_size"], (n,), generator=generator) for n in _SEQ_LENS]


def _token_types(sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(torch.arange(len(seq)) >= len(seq) // 2).long() for seq in sequences]


def _padded(rows: list[torch.Tensor], pad: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def _hf_forward(model: Any, sequences: list[torch.Tensor], pad: int, types: Any = None) -> Any:
    input_ids = _padded(sequences, pad)
    mask = _padded([torch.ones_like(seq) for seq in sequences], 0)
    kwargs = {} if types is None else {"token_type_ids": _padded(types, 0)}
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=mask, **kwargs), mask


def _kvflow_forward(model: Any, sequences: list[torch.Tensor], types: Any = None) -> torch.Tensor:
    with torch.no_grad():
        return model(
            torch.cat(sequences),
            seq_lens=torch.tensor([len(seq) for seq in sequences]),
            token_type_ids=None if types is None else torch.cat(types),
        )


@pytest.mark.parametrize(("kind", "with_types"), [("bert", False), ("bert", True), ("xlmr", False)])
def test_hidden_states_and_pooling_match_transformers(
    checkpoints: dict[str, Path], kind: str, with_types: bool
) -> None:
    path = checkpoints[kind]
    model = load_encoder_model(path, dtype="float32")
    assert isinstance(model, BertEncoderModel)
    sequences = _sequences(kind)
    types = _token_types(sequences) if with_types else None
    pad = model.config.pad_token_id
    hf_out, mask = _hf_forward(_hf_model(path, kind), sequences, pad, types)
    ours = _kvflow_forward(model, sequences, types)
    hf_states = hf_out.last_hidden_state
    start = 0
    for i, seq in enumerate(sequences):
        theirs = hf_states[i, : len(seq)]
        mine = ours[start : start + len(seq)]
        torch.testing.assert_close(mine, theirs, atol=_ATOL, rtol=0)
        torch.testing.assert_close(mine[0], theirs[0], atol=_ATOL, rtol=0)  # CLS pooling
        torch.testing.assert_close(mine.mean(0), theirs.mean(0), atol=_ATOL, rtol=0)  # mean pooling
        start += len(seq)
    assert start == ours.shape[0]
    mean_hf = (hf_states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    starts = model.sequence_starts(torch.cat(sequences), torch.tensor(_SEQ_LENS), None)
    assert starts.tolist() == [0, 7, 8, 27]
    torch.testing.assert_close(ours[starts], hf_states[:, 0], atol=_ATOL, rtol=0)
    ours_mean = torch.stack([rows.mean(0) for rows in ours.split(list(_SEQ_LENS))])
    torch.testing.assert_close(ours_mean, mean_hf, atol=_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bert_cls", "xlmr_cls"])
def test_classification_logits_match_transformers(checkpoints: dict[str, Path], kind: str) -> None:
    path = checkpoints[kind]
    model = load_encoder_model(path, dtype="float32")
    expected_class = (
        BertForSequenceClassification if kind == "bert_cls" else XLMRobertaForSequenceClassification
    )
    assert isinstance(model, expected_class)
    sequences = _sequences(kind, seed=2)
    types = _token_types(sequences) if kind == "bert_cls" else None
    hf_out, _ = _hf_forward(_hf_model(path, kind), sequences, model.config.pad_token_id, types)
    logits = _kvflow_forward(model, sequences, types)
    assert logits.shape == (len(sequences), _KINDS[kind][2]["num_labels"])
    torch.testing.assert_close(logits, hf_out.logits, atol=_ATOL, rtol=0)


def test_query_start_loc_and_base_checkpoint_from_classifier(checkpoints: dict[str, Path]) -> None:
    """A classifier checkpoint's `bert.`-prefixed tensors load into a plain encoder (pooler and head skipped)."""
    path = checkpoints["bert_cls"]
    encoder = BertEncoderModel(
        parse_encoder_config({**_config(path), "architectures": ["BertModel"]})
    )
    from kvflow.models.checkpoint_files import iterate_safetensors_weights

    encoder.load_weights(iterate_safetensors_weights(path))
    sequences = _sequences("bert", seed=3)
    hf_out, _ = _hf_forward(_hf_model(path, "bert_cls").bert, sequences, 0)
    with torch.no_grad():
        ours = encoder(torch.cat(sequences), query_start_loc=torch.tensor([0, 7, 8, 27, 39]))
    torch.testing.assert_close(ours[8:27], hf_out.last_hidden_state[2, :19], atol=_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "xlmr_cls"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariance_bit_for_bit(checkpoints: dict[str, Path], kind: str, dtype: str) -> None:
    model = load_encoder_model(checkpoints[kind], dtype=dtype)
    sequences = _sequences(kind, seed=4)
    batched = _kvflow_forward(model, sequences)
    reordered = _kvflow_forward(model, sequences[::-1])
    start = 0
    for i, seq in enumerate(sequences):
        alone = _kvflow_forward(model, [seq])
        if kind == "bert":
            assert torch.equal(batched[start : start + len(seq)], alone)
            start += len(seq)
        else:
            assert torch.equal(batched[i], alone[0])
            assert torch.equal(reordered[len(sequences) - 1 - i], alone[0])
    assert batched.dtype == getattr(torch, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariance_across_row_tiles(checkpoints: dict[str, Path], dtype: str) -> None:
    """Sequences of 1-3 tokens (a matrix product of so few rows can take another algorithm), and batches of
    several hundred rows: each sequence's rows equal its rows alone."""
    model = load_encoder_model(checkpoints["bert"], dtype=dtype)
    generator = torch.Generator().manual_seed(7)
    lengths = (1, 3, 2, 63, 64, 1, 50, 64, 64, 64, 9)
    sequences = [torch.randint(1, _SHAPE["vocab_size"], (n,), generator=generator) for n in lengths]
    batched = _kvflow_forward(model, sequences)
    start = 0
    for seq in sequences:
        assert torch.equal(batched[start : start + len(seq)], _kvflow_forward(model, [seq]))
        start += len(seq)


def test_bfloat16_close_to_float32(checkpoints: dict[str, Path]) -> None:
    sequences = _sequences("bert", seed=5)
    full = _kvflow_forward(load_encoder_model(checkpoints["bert"], dtype="float32"), sequences)
    half = _kvflow_forward(load_encoder_model(checkpoints["bert"], dtype="bfloat16"), sequences)
    assert half.dtype == torch.bfloat16
    cosine = torch.nn.functional.cosine_similarity(half.float(), full, dim=-1)
    assert cosine.min() > 0.99


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"is_decoder": True}, "is_decoder"),
        ({"add_cross_attention": True}, "add_cross_attention"),
        ({"hidden_act": "swish"}, "hidden_act"),
        ({"architectures": ["BertForMaskedLM"]}, "architectures"),
    ],
)
def test_unsupported_config_is_a_clear_error(
    checkpoints: dict[str, Path], tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_config(checkpoints["bert"]), **change}))
    with pytest.raises(ValueError, match=field):
        load_encoder_model(tmp_path)


def test_bad_batch_layout_is_an_error(checkpoints: dict[str, Path]) -> None:
    model = load_encoder_model(checkpoints["bert"])
    input_ids = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="input_ids has 3"):
        model(input_ids, seq_lens=torch.tensor([2]))
    with pytest.raises(ValueError, match="at least one token"):
        model(input_ids, query_start_loc=torch.tensor([0, 0, 3]))
    with pytest.raises(ValueError, match="longer than"):
        model(torch.ones(65, dtype=torch.long))
