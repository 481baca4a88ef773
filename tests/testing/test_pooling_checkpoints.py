"""The pooling test checkpoints (`kvflow.testing.pooling_checkpoints`) are what they claim: transformers and
sentence-transformers load them, their tokenizers add the right special tokens and token types, the decoder
embedder is laid out like Qwen3-Embedding, and `st_encode` / `hf_classifier_logits` agree with a hand-written
pooling of transformers' hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kvflow.testing.pooling_checkpoints import (
    ENCODER_KINDS,
    hf_classifier_logits,
    make_tiny_decoder_classifier,
    make_tiny_decoder_embedder,
    make_tiny_encoder,
    st_encode,
)
from kvflow.tokenizer.loading import load_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

_TEXTS = ["The capital of France is Paris.", "A man is eating food.", "hello"]
_POOLING = {"bert": "mean", "xlmr": "cls"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    made = {
        kind: make_tiny_encoder(
            root / kind,
            kind,
            sentence_transformers=(
                {"pooling": _POOLING[kind], "normalize": True} if kind in _POOLING else None
            ),
        )
        for kind in ENCODER_KINDS
    }
    for family in ("qwen3", "qwen2"):
        made[f"embed_{family}"] = make_tiny_decoder_embedder(root / f"embed_{family}", family)
        made[f"classify_{family}"] = make_tiny_decoder_classifier(
            root / f"classify_{family}", family, num_labels=3
        )
    return made


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("kind", list(ENCODER_KINDS))
def test_encoder_tokenizer_fills_the_vocabulary_and_marks_pairs(
    folders: dict[str, Path], kind: str
) -> None:
    folder = folders[kind]
    config = _config(folder)
    assert config["architectures"] == [ENCODER_KINDS[kind][1]]
    tokenizer = load_tokenizer(folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.vocab_size == len(hf_tokenizer) == config["vocab_size"]
    pair = hf_tokenizer(_TEXTS[0], _TEXTS[1])
    tokens = hf_tokenizer.convert_ids_to_tokens(pair["input_ids"])
    if kind.startswith("bert"):
        assert tokens[:3] == ["[CLS]", "the", "capital"]  # lowercased, whole words
        assert tokens.count("[SEP]") == 2 and tokens[-1] == "[SEP]"
        split = tokens.index("[SEP]") + 1
        assert pair["token_type_ids"] == [0] * split + [1] * (len(tokens) - split)
        assert config["pad_token_id"] == 0
    else:
        assert tokens[:2] == ["<s>", "\u2581The"]
        assert tokens.count("</s>") == 3 and tokens[-1] == "</s>"
        assert "</s></s>" in "".join(tokens)
        assert config["pad_token_id"] == hf_tokenizer.pad_token_id == 1
    assert tokenizer.encode(_TEXTS[0]) == hf_tokenizer(_TEXTS[0])["input_ids"]


@pytest.mark.parametrize("kind", list(_POOLING))
def test_st_encode_is_the_pooled_normalized_hidden_state(
    folders: dict[str, Path], kind: str
) -> None:
    folder = folders[kind]
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    assert pooling["word_embedding_dimension"] == _config(folder)["hidden_size"]
    assert pooling[
        "pooling_mode_mean_tokens" if _POOLING[kind] == "mean" else "pooling_mode_cls_token"
    ]
    modules = json.loads((folder / "modules.json").read_text())
    assert [module["path"] for module in modules] == ["", "1_Pooling", "2_Normalize"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for text in _TEXTS:
            ids = torch.tensor([hf_tokenizer(text)["input_ids"]])
            states = model(input_ids=ids).last_hidden_state[0]
            pooled = states.mean(0) if _POOLING[kind] == "mean" else states[0]
            expected.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    np.testing.assert_allclose(st_encode(folder, _TEXTS), np.stack(expected), atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_decoder_embedder_is_laid_out_like_qwen3_embedding(
    folders: dict[str, Path], family: str
) -> None:
    folder = folders[f"embed_{family}"]
    config = _config(folder)
    assert config["architectures"] == ["Qwen3ForCausalLM" if family == "qwen3" else "Qwen2Model"]
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    assert "embed_tokens.weight" in names and "norm.weight" in names
    assert not any(name.startswith(("model.", "lm_head")) for name in names)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf_tokenizer.padding_side == "left"
    ids = hf_tokenizer(_TEXTS[0])["input_ids"]
    assert ids[-1] == hf_tokenizer.eos_token_id == hf_tokenizer.pad_token_id
    assert hf_tokenizer.convert_ids_to_tokens(ids[-1:]) == ["<|endoftext|>"]
    assert load_tokenizer(folder).encode(_TEXTS[0]) == ids
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode_lasttoken"]
    # transformers loads the base model from the un-prefixed tensors; sentence-transformers pools its last state.
    base = getattr(transformers, f"{family.capitalize()}Model")
    model = base.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        last = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    expected = torch.nn.functional.normalize(last, dim=0).numpy()
    np.testing.assert_allclose(st_encode(folder, _TEXTS[:1])[0], expected, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_decoder_classifier_has_a_pad_token_and_a_score_head(
    folders: dict[str, Path], family: str
) -> None:
    folder = folders[f"classify_{family}"]
    config = _config(folder)
    assert config["architectures"] == [f"{family.capitalize()}ForSequenceClassification"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert config["pad_token_id"] == hf_tokenizer.pad_token_id is not None
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert weights.get_tensor("score.weight").shape == (3, config["hidden_size"])
    ids = [hf_tokenizer(text)["input_ids"] for text in _TEXTS]
    logits = hf_classifier_logits(folder, ids)
    assert logits.shape == (3, 3) and logits.dtype == torch.float32
    assert torch.equal(hf_classifier_logits(folder, ids[1:2])[0], logits[1])


def test_encoder_classifier_logits_use_the_token_types(folders: dict[str, Path]) -> None:
    folder = folders["bert_cls"]
    assert len(_config(folder)["id2label"]) == 1  # a reranker: one score
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    pair = hf_tokenizer(_TEXTS[0], _TEXTS[1])
    with_types = hf_classifier_logits(folder, [pair["input_ids"]], [pair["token_type_ids"]])
    without = hf_classifier_logits(folder, [pair["input_ids"]])
    assert with_types.shape == (1, 1)
    assert not torch.equal(with_types, without)


def test_the_same_seed_writes_the_same_checkpoint(tmp_path: Path) -> None:
    first = make_tiny_encoder(tmp_path / "a", "xlmr", seed=3, num_hidden_layers=1)
    second = make_tiny_encoder(tmp_path / "b", "xlmr", seed=3, num_hidden_layers=1)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown encoder kind"):
        make_tiny_encoder(tmp_path / "x", "gpt")
    with pytest.raises(ValueError, match="classifiers"):
        make_tiny_encoder(tmp_path / "x", "bert_cls", sentence_transformers={"pooling": "cls"})
    with pytest.raises(ValueError, match="pooling must be"):
        make_tiny_encoder(tmp_path / "x", "bert", sentence_transformers={"pooling": "max"})
    with pytest.raises(ValueError, match="unknown decoder family"):
        make_tiny_decoder_embedder(tmp_path / "x", "llama")
