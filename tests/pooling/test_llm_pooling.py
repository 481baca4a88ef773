"""The pooling runner end to end (`LLM(runner="pooling")`): embeddings against sentence-transformers, classifier
and cross-encoder scores against transformers, on tiny random checkpoints with real tokenizers; pooling types,
normalize, dimensions, truncation, batch invariance, chunked prefill and the errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow import LLM
from kvflow.models.loader import cpu_has_native_bf16
from kvflow.pooling_params import PoolingParams
from kvflow.testing.pooling_checkpoints import (
    hf_classifier_logits,
    make_tiny_decoder_classifier,
    make_tiny_decoder_embedder,
    make_tiny_encoder,
    st_encode,
)

pytest.importorskip("sentence_transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A cat sleeps.",
    "Retrieval pipelines embed every document once and every query at search time, then rank by similarity.",
    "hello",
]
_ATOL = 1e-5


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling")
    return {
        "bert_mean": make_tiny_encoder(
            root / "bert_mean", "bert", sentence_transformers={"pooling": "mean", "normalize": True}
        ),
        "xlmr_cls": make_tiny_encoder(root / "xlmr_cls", "xlmr_cls"),
        "bert_cls": make_tiny_encoder(root / "bert_cls", "bert_cls"),
        "qwen3_embed": make_tiny_decoder_embedder(root / "qwen3_embed", "qwen3"),
        "qwen2_cls": make_tiny_decoder_classifier(root / "qwen2_cls", "qwen2", num_labels=3),
        "qwen3_cls": make_tiny_decoder_classifier(root / "qwen3_cls", "qwen3", num_labels=2),
        "qwen2_embed": make_tiny_decoder_embedder(
            root / "qwen2_embed",
            "qwen2",
            sentence_transformers={"pooling": "mean", "normalize": True},
        ),
        "xlmr_embed": make_tiny_encoder(
            root / "xlmr_embed", "xlmr", sentence_transformers={"pooling": "cls", "normalize": True}
        ),
    }


@pytest.fixture(scope="module")
def bert_embedder(folders: dict[str, Path]) -> LLM:
    # runner "auto": a sentence-transformers folder; float32 (the pooling runner's "auto" would be bfloat16 on a
    # CPU with native bf16) for the comparisons at 1e-5.
    return LLM(str(folders["bert_mean"]), max_num_seqs=8, dtype="float32")


def _model_dtype(worker: Any) -> torch.dtype:
    """On the worker: the dtype its model's weights are held in."""
    return next(worker.model.parameters()).dtype


def test_auto_runner_and_sentence_transformers_defaults(bert_embedder: LLM) -> None:
    assert bert_embedder.collective_rpc(_model_dtype) == [
        torch.float32
    ]  # an explicit dtype is kept
    model_config = bert_embedder.engine_config.model_config
    assert model_config.runner == "pooling"
    assert model_config.pooling is not None
    assert model_config.pooling.pooler_config.pooling_type == "MEAN"
    assert model_config.pooling.pooler_config.normalize is True
    assert bert_embedder.supported_tasks == ("embed", "encode", "score")
    # An encoder runs whole prompts: no chunking, no prefix cache, no overlapped steps.
    config = bert_embedder.engine_config
    assert not config.scheduler_config.enable_chunked_prefill
    assert not config.cache_config.enable_prefix_caching
    assert not config.scheduler_config.async_scheduling


def test_bert_embeddings_match_sentence_transformers(
    bert_embedder: LLM, folders: dict[str, Path]
) -> None:
    outputs = bert_embedder.embed(TEXTS, use_tqdm=False)
    reference = st_encode(folders["bert_mean"], TEXTS)
    for output, expected in zip(outputs, reference, strict=True):
        got = np.asarray(output.outputs.embedding, dtype=np.float32)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=_ATOL)
        assert _cosine(got, expected) >= 0.99999
        assert abs(np.linalg.norm(got) - 1.0) < 1e-5


def test_embedding_is_bit_identical_alone_and_in_any_batch(bert_embedder: LLM) -> None:
    alone = bert_embedder.embed([TEXTS[2]], use_tqdm=False)[0].outputs.embedding
    batched = bert_embedder.embed([TEXTS[0], TEXTS[2], TEXTS[1], TEXTS[3]], use_tqdm=False)
    reversed_batch = bert_embedder.embed(TEXTS[::-1], use_tqdm=False)
    assert batched[1].outputs.embedding == alone
    assert reversed_batch[1].outputs.embedding == alone


def test_dtype_auto_serves_float32_checkpoints_in_bfloat16_on_a_native_bf16_cpu(
    folders: dict[str, Path],
) -> None:
    """The pooling runner's "auto" (vLLM's downcast): a float32 encoder and a float32 decoder embedder run in
    bfloat16 where the CPU has native bf16 arithmetic (this test machine: AVX512_BF16), float32 elsewhere; the same
    decoder checkpoint generating keeps the checkpoint's float32."""
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    encoder = LLM(str(folders["bert_mean"]), max_num_seqs=4)
    assert encoder.collective_rpc(_model_dtype) == [expected]
    alone = [encoder.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    batched = encoder.embed(TEXTS[::-1], use_tqdm=False)
    assert [output.outputs.embedding for output in batched[::-1]] == alone
    # bfloat16 against sentence-transformers' float32: this tiny random model agrees to cosine >= 0.9998.
    for got, reference in zip(alone, st_encode(folders["bert_mean"], TEXTS), strict=True):
        assert _cosine(np.asarray(got), reference) >= 0.999
    encoder.shutdown()
    decoder = LLM(str(folders["qwen3_embed"]), max_num_seqs=4, num_kv_blocks=64)
    assert decoder.collective_rpc(_model_dtype) == [expected]
    got = decoder.embed(TEXTS[2], use_tqdm=False)[0].outputs.embedding
    assert _cosine(np.asarray(got), st_encode(folders["qwen3_embed"], [TEXTS[2]])[0]) >= 0.999
    decoder.shutdown()
    generator = LLM(
        str(folders["qwen3_embed"]), runner="generate", max_num_seqs=4, num_kv_blocks=64
    )
    assert generator.collective_rpc(_model_dtype) == [torch.float32]
    generator.shutdown()


def test_normalize_encode_and_token_id_prompts(bert_embedder: LLM) -> None:
    token_ids = bert_embedder.get_tokenizer().encode(TEXTS[0])
    normalized = bert_embedder.embed({"prompt_token_ids": token_ids}, use_tqdm=False)[0]
    raw = bert_embedder.embed(
        {"prompt_token_ids": token_ids}, PoolingParams(normalize=False), use_tqdm=False
    )[0]
    raw_values = torch.tensor(raw.outputs.embedding)
    assert abs(float(raw_values.norm()) - 1.0) > 1e-3
    expected = torch.nn.functional.normalize(raw_values, dim=0)
    torch.testing.assert_close(torch.tensor(normalized.outputs.embedding), expected)
    encoded = bert_embedder.encode({"prompt_token_ids": token_ids}, use_tqdm=False)[0]
    assert encoded.outputs.data.dtype == torch.float32
    torch.testing.assert_close(encoded.outputs.data, raw_values)
    assert encoded.prompt_token_ids == token_ids


def test_truncation_and_length_errors(bert_embedder: LLM) -> None:
    max_model_len = bert_embedder.engine_config.scheduler_config.max_model_len
    long_prompt = {"prompt_token_ids": list(range(5, 5 + max_model_len + 3))}
    with pytest.raises(ValueError, match="max_model_len"):
        bert_embedder.embed(long_prompt, use_tqdm=False)
    kept = bert_embedder.embed(long_prompt, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert kept.prompt_token_ids == long_prompt["prompt_token_ids"][-10:]
    whole = bert_embedder.embed(long_prompt, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(whole.prompt_token_ids) == max_model_len


def test_errors_name_the_field_and_the_runner(bert_embedder: LLM) -> None:
    with pytest.raises(ValueError, match="dimensions"):
        bert_embedder.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="classify"):
        bert_embedder.classify(TEXTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        bert_embedder.generate(TEXTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pooling_type"):
        LLM("hash", runner="generate", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="pooler_config needs runner='pooling'"):
        LLM("hash", pooler_config={"pooling_type": "MEAN"})
    # The engine still works after every refusal.
    assert len(bert_embedder.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding) == 64


def test_score_with_an_embedding_model_is_the_cosine(bert_embedder: LLM) -> None:
    scores = bert_embedder.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    embeddings = [
        np.asarray(o.outputs.embedding) for o in bert_embedder.embed(TEXTS, use_tqdm=False)
    ]
    assert len(scores) == 3
    for score, other in zip(scores, embeddings[1:], strict=True):
        assert score.outputs.score == pytest.approx(_cosine(embeddings[0], other), abs=1e-6)


def test_a_folder_sentence_transformers_6_writes(folders: dict[str, Path], tmp_path: Path) -> None:
    """sentence-transformers 6 saves `pooling_mode` (not the `pooling_mode_*` flags) and longer module class
    paths; a max-pooling model is refused, naming the mode, rather than embedded otherwise."""
    from sentence_transformers import SentenceTransformer, models

    def save(mode: str) -> Path:
        transformer = models.Transformer(str(folders["bert_mean"]))
        pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode=mode)
        model = SentenceTransformer(
            modules=[transformer, pooling, models.Normalize()], device="cpu"
        )
        model.save(str(tmp_path / mode))
        return tmp_path / mode

    folder = save("cls")
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4)
    assert llm.engine_config.model_config.pooling.pooler_config.pooling_type == "CLS"  # type: ignore[union-attr]
    got = np.asarray(llm.embed(TEXTS[2], use_tqdm=False)[0].outputs.embedding)
    np.testing.assert_allclose(got, st_encode(folder, [TEXTS[2]])[0], atol=_ATOL)
    with pytest.raises(ValueError, match="pooling mode 'max'"):
        LLM(str(save("max")))


def test_matryoshka_dimensions(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "matryoshka"
    make_tiny_encoder(folder, "bert", sentence_transformers={"pooling": "cls", "normalize": True})
    config_file = folder / "config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "matryoshka_dimensions": [16, 32, 64]})
    )
    llm = LLM(str(folder), dtype="float32", runner="pooling", max_num_seqs=4)
    full = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    short = llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = torch.nn.functional.normalize(torch.tensor(full.outputs.embedding[:16]), dim=0)
    torch.testing.assert_close(torch.tensor(short.outputs.embedding), expected)
    with pytest.raises(ValueError, match="dimensions=20"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=20), use_tqdm=False)
    reference = st_encode(folder, [TEXTS[0]], truncate_dim=32)[0]
    got = llm.embed(TEXTS[0], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(np.asarray(got), reference / np.linalg.norm(reference), atol=_ATOL)


@pytest.mark.parametrize("kind", ["bert_cls", "xlmr_cls"])
def test_cross_encoder_scores_match_transformers(folders: dict[str, Path], kind: str) -> None:
    llm = LLM(str(folders[kind]), dtype="float32", max_num_seqs=4)
    assert llm.supported_tasks == ("classify", "score", "encode")
    query, documents = TEXTS[0], TEXTS[1:]
    scores = llm.score(query, documents, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    pairs = [tokenizer.encode_pair(query, document) for document in documents]
    if kind == "bert_cls":
        assert any(1 in types for _, types in pairs)  # BERT pairs carry token type 1
    logits = hf_classifier_logits(
        folders[kind], [ids for ids, _ in pairs], [types for _, types in pairs]
    )
    expected = torch.sigmoid(logits[:, 0])
    got = torch.tensor([score.outputs.score for score in scores])
    torch.testing.assert_close(got, expected, atol=_ATOL, rtol=0)
    # N:N pairs in order, and the same pair alone scores the same, bit for bit.
    pairwise = llm.score([query, query], [documents[1], documents[0]], use_tqdm=False)
    assert pairwise[0].outputs.score == scores[1].outputs.score
    assert pairwise[1].outputs.score == scores[0].outputs.score
    with pytest.raises(ValueError, match="text_1"):
        llm.score([query, query], documents, use_tqdm=False)


def test_decoder_embedder_matches_sentence_transformers(folders: dict[str, Path]) -> None:
    folder = folders["qwen3_embed"]
    # A small token budget: long prompts run in several chunks; LAST pooling keeps chunking and the prefix cache.
    llm = LLM(
        str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64
    )
    config = llm.engine_config
    assert config.model_config.pooling is not None
    assert config.model_config.pooling.pooler_config.pooling_type == "LAST"
    assert config.scheduler_config.enable_chunked_prefill
    reference = st_encode(folder, TEXTS)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    for output, expected in zip(outputs, reference, strict=True):
        got = np.asarray(output.outputs.embedding, dtype=np.float32)
        np.testing.assert_allclose(got, expected, atol=_ATOL)
        assert _cosine(got, expected) >= 0.99999
    # The same text again reads its prefix from the cache and gets the same embedding.
    again = llm.embed(TEXTS[2], use_tqdm=False)[0]
    np.testing.assert_allclose(
        np.asarray(again.outputs.embedding), np.asarray(outputs[2].outputs.embedding), atol=1e-6
    )


def test_decoder_embedding_is_bit_identical_alone_and_in_any_batch(
    folders: dict[str, Path],
) -> None:
    """Without prefix reuse (a hit computes the prompt in two pieces) and with whole prompts per step, a decoder's
    embedding is the same alone and among others: every product of the pooling runner is batch-invariant."""
    llm = LLM(
        str(folders["qwen3_embed"]),
        dtype="float32",
        max_num_seqs=4,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    )
    alone = [llm.embed(text, use_tqdm=False)[0].outputs.embedding for text in TEXTS]
    batched = llm.embed(TEXTS[::-1], use_tqdm=False)
    assert [output.outputs.embedding for output in batched[::-1]] == alone


def test_decoder_mean_and_all_pooling(folders: dict[str, Path]) -> None:
    llm = LLM(
        str(folders["qwen3_embed"]),
        dtype="float32",
        max_num_seqs=4,
        pooler_config={"pooling_type": "ALL"},
        num_kv_blocks=64,
    )
    config = llm.engine_config
    assert (
        not config.scheduler_config.enable_chunked_prefill
    )  # every token's state is needed at once
    assert not config.cache_config.enable_prefix_caching
    token_ids = llm.get_tokenizer().encode(TEXTS[2])
    states = llm.encode({"prompt_token_ids": token_ids}, use_tqdm=False)[0].outputs.data
    assert states.shape == (len(token_ids), 64)
    llm_mean = LLM(
        str(folders["qwen3_embed"]),
        dtype="float32",
        max_num_seqs=4,
        pooler_config={"pooling_type": "MEAN", "normalize": False},
        num_kv_blocks=64,
    )
    mean = llm_mean.embed({"prompt_token_ids": token_ids}, use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(mean), states.mean(dim=0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2_embed", "xlmr_embed"])
def test_other_embedders_match_sentence_transformers(folders: dict[str, Path], kind: str) -> None:
    """gte-Qwen2-style (`Qwen2Model`, mean pooling: each prompt whole in one step) and an XLM-RoBERTa encoder
    (CLS pooling)."""
    llm = LLM(str(folders[kind]), dtype="float32", max_num_seqs=4, num_kv_blocks=64)
    assert llm.engine_config.model_config.runner == "pooling"
    reference = st_encode(folders[kind], TEXTS)
    for output, expected in zip(llm.embed(TEXTS, use_tqdm=False), reference, strict=True):
        np.testing.assert_allclose(np.asarray(output.outputs.embedding), expected, atol=_ATOL)


@pytest.mark.parametrize("kind", ["qwen2_cls", "qwen3_cls"])
def test_decoder_classifier_matches_transformers(folders: dict[str, Path], kind: str) -> None:
    folder = folders[kind]
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, num_kv_blocks=64)
    if kind == "qwen3_cls":
        outputs = llm.classify(TEXTS, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        logits = hf_classifier_logits(folder, [tokenizer.encode(text) for text in TEXTS])
        got = torch.tensor([output.outputs.probs for output in outputs])
        torch.testing.assert_close(got, torch.softmax(logits, dim=-1), atol=_ATOL, rtol=0)
        return
    assert llm.supported_tasks == ("classify", "encode")
    tokenizer = llm.get_tokenizer()
    outputs = llm.classify(TEXTS, use_tqdm=False)
    logits = hf_classifier_logits(folder, [tokenizer.encode(text) for text in TEXTS])
    got = torch.tensor([output.outputs.probs for output in outputs])
    torch.testing.assert_close(got, torch.softmax(logits, dim=-1), atol=_ATOL, rtol=0)
    raw = llm.classify(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), logits[0], atol=_ATOL, rtol=0)
    with pytest.raises(ValueError, match="score"):
        llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)  # three labels: no single relevance score


def test_async_llm_encode(folders: dict[str, Path]) -> None:
    asyncio.run(asyncio.wait_for(_async_llm_encode(folders), 120))


async def _async_llm_encode(folders: dict[str, Path]) -> None:
    from kvflow import AsyncLLM

    async with AsyncLLM(str(folders["bert_mean"]), dtype="float32", max_num_seqs=4) as engine:
        results = [
            output async for output in engine.encode(TEXTS[0], PoolingParams(task="embed"), "req-1")
        ]
        assert len(results) == 1 and results[0].finished
        assert results[0].request_id == "req-1"
        expected = st_encode(folders["bert_mean"], [TEXTS[0]])[0]
        np.testing.assert_allclose(results[0].outputs.data.numpy(), expected, atol=_ATOL)
        with pytest.raises(ValueError, match="runner='generate'"):
            async for _ in engine.generate(TEXTS[0]):
                pass
